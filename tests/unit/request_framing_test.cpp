#include "api/request_framing.h"

#include <gtest/gtest.h>

#include <string>

using namespace rdmig::api;

namespace {

constexpr uint64_t kLimit = 65536;

std::string head_with(const std::string& headers) {
  return "POST /v1/migrations HTTP/1.1\r\nHost: x\r\n" + headers + "\r\n";
}

BodyFraming framing_of(const std::string& headers) {
  const std::string head = head_with(headers);
  auto r = check_request_head(head, kLimit);
  if (const auto* e = std::get_if<FramingError>(&r)) ADD_FAILURE() << headers << " -> " << e->status << " " << e->message;
  return std::get_if<BodyFraming>(&r) ? std::get<BodyFraming>(r) : BodyFraming{};
}

FramingError refusal_of(const std::string& headers) {
  auto r = check_request_head(head_with(headers), kLimit);
  if (!std::get_if<FramingError>(&r)) {
    ADD_FAILURE() << headers << " was accepted";
    return {};
  }
  return std::get<FramingError>(r);
}

// Feeds `body` to a ChunkedBody in pieces of `step` bytes; the refusal, or the bytes it took.
std::variant<size_t, FramingError> feed_all(const std::string& body, size_t step, uint64_t limit = kLimit) {
  ChunkedBody chunked(limit);
  size_t taken = 0;
  for (size_t pos = 0; pos < body.size() && !chunked.done(); pos += step) {
    auto r = chunked.feed(std::string_view(body).substr(pos, step));
    if (std::get_if<FramingError>(&r)) return r;
    taken += std::get<size_t>(r);
  }
  if (!chunked.done()) return FramingError{0, "not done"};
  return taken;
}

}  // namespace

TEST(RequestFraming, FindsTheEndOfTheHeadWithOrWithoutCr) {
  EXPECT_EQ(find_head_end("GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"), 27u);
  EXPECT_EQ(find_head_end("GET / HTTP/1.1\nHost: x\n\nbody"), 24u);
  EXPECT_EQ(find_head_end("GET / HTTP/1.1\r\nHost: x\r\n"), std::string::npos);
  // Looked at again from where the previous look stopped: an end split across reads is found.
  EXPECT_EQ(find_head_end("GET / HTTP/1.1\r\nHost: x\r\n\r\n", 26), 27u);
}

TEST(RequestFraming, ReadsContentLengthChunkedAndNoBody) {
  auto f = framing_of("Content-Length: 17\r\n");
  EXPECT_EQ(f.kind, BodyFraming::Kind::kLength);
  EXPECT_EQ(f.length, 17u);
  EXPECT_EQ(f.head_bytes, head_with("Content-Length: 17\r\n").size());
  EXPECT_EQ(framing_of("content-length:\t0065536 \r\n").length, 65536u);  // leading zeros, OWS, any case
  EXPECT_EQ(framing_of("Transfer-Encoding: Chunked\r\n").kind, BodyFraming::Kind::kChunked);
  EXPECT_EQ(framing_of("Transfer-Encoding: ,chunked, \r\n").kind, BodyFraming::Kind::kChunked);  // empty items
  EXPECT_EQ(framing_of("X-Other: a\r\n").kind, BodyFraming::Kind::kNone);
}

TEST(RequestFraming, RefusesInvalidContentLengthWith400NamingIt) {
  for (const char* bad : {"-5", "+5", "5x", "0x10", "5 5", "", "1e3", "5.0"}) {
    const auto e = refusal_of(std::string("Content-Length: ") + bad + "\r\n");
    EXPECT_EQ(e.status, 400) << bad;
    EXPECT_NE(e.message.find("header 'Content-Length'"), std::string::npos) << e.message;
  }
  EXPECT_NE(refusal_of("Content-Length: -5\r\n").message.find("'-5' is not a length"), std::string::npos);
  EXPECT_NE(refusal_of("Content-Length:\r\n").message.find("empty"), std::string::npos);
}

TEST(RequestFraming, RefusesEveryDuplicateOrListedContentLength) {
  for (const char* dup : {"Content-Length: 5\r\nContent-Length: 6\r\n", "Content-Length: 5\r\ncontent-length: 5\r\n"}) {
    const auto e = refusal_of(dup);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.message, "header 'Content-Length': given more than once");
  }
  const auto e = refusal_of("Content-Length: 5, 5\r\n");
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(e.message.find("header 'Content-Length'"), std::string::npos);
}

TEST(RequestFraming, ContentLengthOverTheLimitIs413HoweverManyDigits) {
  EXPECT_EQ(framing_of("Content-Length: 65536\r\n").length, kLimit);
  for (const char* big : {"65537", "20000000", "18446744073709551615", "18446744073709551616",
                          "99999999999999999999", "000000000000000000000000000065537"}) {
    const auto e = refusal_of(std::string("Content-Length: ") + big + "\r\n");
    EXPECT_EQ(e.status, 413) << big;
    EXPECT_NE(e.message.find("header 'Content-Length'"), std::string::npos) << e.message;
    EXPECT_NE(e.message.find("api.maxBodyBytes (65536 bytes)"), std::string::npos) << e.message;
  }
}

TEST(RequestFraming, RefusesTransferEncodingOtherThanOneChunkedAndBothHeaders) {
  for (const char* te : {"gzip", "gzip, chunked", "chunked, gzip", "chunked, chunked", "identity", ",", "chunked;x=1"}) {
    const auto e = refusal_of(std::string("Transfer-Encoding: ") + te + "\r\n");
    EXPECT_EQ(e.status, 400) << te;
    EXPECT_NE(e.message.find("header 'Transfer-Encoding'"), std::string::npos) << e.message;
  }
  // Two field lines make one list: chunked twice.
  EXPECT_EQ(refusal_of("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n").status, 400);
  const auto e = refusal_of("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.message, "header 'Content-Length': not allowed together with Transfer-Encoding");
}

TEST(RequestFraming, RefusesMalformedHeaderLines) {
  EXPECT_EQ(refusal_of("Content-Length : 5\r\n").message, "header 'Content-Length': whitespace before ':'");
  EXPECT_EQ(refusal_of("X-A: 1\r\n folded\r\n").message, "header 'X-A': a folded line (obs-fold) is not accepted");
  EXPECT_EQ(refusal_of("no colon here\r\n").status, 400);
  EXPECT_EQ(refusal_of("Bad\x01Name: 1\r\n").status, 400);
  auto r = check_request_head("GET / HTTP/1.1\r\n Host: x\r\n\r\n", kLimit);
  ASSERT_TRUE(std::get_if<FramingError>(&r));
  EXPECT_EQ(std::get<FramingError>(r).message, "request head: whitespace before the first header");
}

TEST(RequestFraming, HeaderLineOverItsLimitIs431NamingIt) {
  const auto e = refusal_of("X-Big: " + std::string(kMaxHeaderLine, 'a') + "\r\n");
  EXPECT_EQ(e.status, 431);
  EXPECT_NE(e.message.find("header 'X-Big': line longer than 8192 bytes"), std::string::npos) << e.message;
}

TEST(RequestFraming, HeadOverTheLimitIs414ForTheRequestLineElse431NamingTheHeader) {
  const size_t limit = 16384;
  auto e = head_too_large("GET /" + std::string(limit, 'a'), limit);
  EXPECT_EQ(e.status, 414);
  EXPECT_EQ(e.message, "request line: longer than 16384 bytes");
  e = head_too_large(std::string("GET / HTTP/1.1\r\nHost: x\r\nX-Big: ") + std::string(limit, 'a'), limit);
  EXPECT_EQ(e.status, 431);
  EXPECT_EQ(e.message, "header 'X-Big': request head larger than 16384 bytes");
  std::string many = "GET / HTTP/1.1\r\n";
  while (many.size() < limit) many += "X-Many: " + std::string(100, 'b') + "\r\n";
  e = head_too_large(many, limit);
  EXPECT_EQ(e.status, 431);
  EXPECT_NE(e.message.find("request head larger than 16384 bytes"), std::string::npos) << e.message;
}

TEST(ChunkedBody, FollowsChunksExtensionsAndTrailersInAnySplit) {
  const std::string body = "5\r\nhello\r\n1A;name=value\r\n" + std::string(26, 'x') + "\r\n0\r\nX-Trailer: 1\r\n\r\n";
  for (size_t step : {1u, 2u, 7u, 1000u}) {
    auto r = feed_all(body + "GET /next", step);
    ASSERT_TRUE(std::get_if<size_t>(&r)) << step << ": " << std::get<FramingError>(r).message;
    EXPECT_EQ(std::get<size_t>(r), body.size()) << step;  // stops at the end of the body
  }
  ChunkedBody chunked(kLimit);
  (void)chunked.feed("3\r\nabc\r\n0\r\n\r\n");
  EXPECT_TRUE(chunked.done());
  EXPECT_EQ(chunked.total(), 3u);
}

TEST(ChunkedBody, ChunkSizeOverTheLimitIs413AsSoonAsItsDigitsShowIt) {
  ChunkedBody chunked(kLimit);
  auto r = chunked.feed("10000");  // 65536: fits, no line end yet
  ASSERT_TRUE(std::get_if<size_t>(&r));
  r = chunked.feed("0");  // 1 MiB: refused before the line ends, before any data
  ASSERT_TRUE(std::get_if<FramingError>(&r));
  EXPECT_EQ(std::get<FramingError>(r).status, 413);
  EXPECT_NE(std::get<FramingError>(r).message.find("api.maxBodyBytes (65536 bytes)"), std::string::npos);
  // A size that would overflow 64 bits, and many small chunks that together pass the limit.
  r = feed_all("ffffffffffffffffffffffff\r\n", 1);
  EXPECT_EQ(std::get<FramingError>(r).status, 413);
  std::string many;
  for (int i = 0; i < 5000; ++i) many += "10\r\n" + std::string(16, 'y') + "\r\n";
  r = feed_all(many, 4096);
  EXPECT_EQ(std::get<FramingError>(r).status, 413);
}

TEST(ChunkedBody, RefusesBadFramingWith400) {
  for (const char* bad : {"x\r\n", "-1\r\n", "\r\n", " 5\r\n", "0x5\r\n", "5\rX", "3\r\nabcd\r\n", "3\r\nabc\n\n"}) {
    auto r = feed_all(std::string(bad) + "0\r\n\r\n", 1);
    ASSERT_TRUE(std::get_if<FramingError>(&r)) << bad;
    EXPECT_EQ(std::get<FramingError>(r).status, 400) << bad;
    EXPECT_NE(std::get<FramingError>(r).message.find("body (chunked)"), std::string::npos);
  }
  auto r = feed_all("5;" + std::string(kMaxChunkLine, 'e') + "\r\nhello\r\n0\r\n\r\n", 100);
  EXPECT_EQ(std::get<FramingError>(r).status, 400);
  EXPECT_NE(std::get<FramingError>(r).message.find("longer than 4096 bytes"), std::string::npos);
}
