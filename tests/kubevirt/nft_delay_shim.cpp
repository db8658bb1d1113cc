/* Test double for the relay tests (LD_PRELOAD into rdmig-agent): makes libnftables slow on
 * purpose, as a busy or wedged netlink can be, so a test can show what waits behind it.
 * Every nft_run_cmd_from_buffer() whose commands contain $RDMIG_TEST_NFT_SLOW_MATCH (or, with
 * $RDMIG_TEST_NFT_SLOW_WHOLE=1, are exactly that text) sleeps
 * $RDMIG_TEST_NFT_SLOW_SECONDS (a decimal number) before it runs for real, while the file
 * $RDMIG_TEST_NFT_SLOW_FILE exists (so a test can arm and disarm it under a running agent), and
 * creates $RDMIG_TEST_NFT_SLOW_FILE.held as it starts to sleep (so the test knows). */
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

struct nft_ctx;

extern "C" int nft_run_cmd_from_buffer(nft_ctx* nft, const char* buf) {
  using Run = int (*)(nft_ctx*, const char*);
  static const Run real = reinterpret_cast<Run>(dlsym(RTLD_NEXT, "nft_run_cmd_from_buffer"));
  const char* match = std::getenv("RDMIG_TEST_NFT_SLOW_MATCH");
  const char* secs = std::getenv("RDMIG_TEST_NFT_SLOW_SECONDS");
  const char* file = std::getenv("RDMIG_TEST_NFT_SLOW_FILE");
  const char* whole = std::getenv("RDMIG_TEST_NFT_SLOW_WHOLE");
  const bool matches = match && buf && (whole && std::strcmp(whole, "1") == 0 ? std::strcmp(buf, match) == 0
                                                                           : std::strstr(buf, match) != nullptr);
  if (matches && secs && file && ::access(file, F_OK) == 0) {
    // "<file>.held": the test knows a call is being held now.
    const std::string held = std::string(file) + ".held";
    if (const int fd = ::open(held.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600); fd >= 0) ::close(fd);
    std::this_thread::sleep_for(std::chrono::duration<double>(std::strtod(secs, nullptr)));
  }
  return real(nft, buf);
}
