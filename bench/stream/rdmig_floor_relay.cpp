// rdmig-floor-relay: a whole migration's floor. The simplest relay with the agents' hops between
// two real QEMUs (bench/run.py's "floor" row): QEMU's outgoing connections (unix socket) -> one
// loopback TCP connection each -> the target QEMU's incoming unix socket, every connection relayed
// both ways by one thread per direction and side (floor.h: read/write or splice through a pipe),
// with no framing, credits, metrics, handshake or security. What the agents spend above it on a
// whole migration is rdmig's; what it spends above QEMU direct is the hops' (two more processes
// and a TCP connection between the QEMUs).
//
//   rdmig-floor-relay source --listen UNIX_PATH --peer HOST:PORT [--chunk 1Mi] [--splice]
//   rdmig-floor-relay target --listen HOST --qemu UNIX_PATH [--chunk 1Mi] [--splice]
//
// The target side listens on a port the kernel chooses and prints "listening PORT". Each
// side takes connections one at a time and dials the next hop before it takes the next, so QEMU's
// connections reach the target QEMU in the order the source QEMU made them (multifd's main
// channel first, as QEMU 7.2 needs). Runs until killed.
#include <csignal>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "common/net.h"
#include "common/units.h"
#include "floor.h"

using namespace rdmig;
using namespace std::chrono_literals;

namespace {

int usage_error(const std::string& m) {
  std::cerr << "rdmig-floor-relay: " << m << "\n"
            << "usage: rdmig-floor-relay source --listen UNIX_PATH --peer HOST:PORT [--chunk 1Mi] [--splice]\n"
               "       rdmig-floor-relay target --listen HOST --qemu UNIX_PATH [--chunk 1Mi] [--splice]\n";
  return 2;
}

// Relays one connection both ways until both directions ended, then closes both sockets.
void relay(UniqueFd a, UniqueFd b, size_t chunk, bool splice) {
  std::thread fwd(floor_copy, "floor-fwd", a.get(), b.get(), chunk, splice, FloorFraming::kNone);
  floor_copy("floor-ret", b.get(), a.get(), chunk, splice);
  fwd.join();
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  if (argc < 2) return usage_error("source or target?");
  const std::string side = argv[1];
  if (side != "source" && side != "target") return usage_error("source or target?");
  std::string listen, peer, qemu;
  size_t chunk = size_t{1} << 20;
  bool splice = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--listen") listen = val();
    else if (a == "--peer") peer = val();
    else if (a == "--qemu") qemu = val();
    else if (a == "--splice") splice = true;
    else if (a == "--chunk") {
      auto v = parse_bytes(val(), "--chunk");
      if (!v || v.value() == 0) return usage_error("bad --chunk");
      chunk = v.value();
    } else return usage_error("unknown argument " + a);
  }
  if (listen.empty() || (side == "source" ? peer.empty() : qemu.empty())) return usage_error("missing arguments");

  Result<UniqueFd> l = Error{Errc::kInternal, "not listening"};
  if (side == "source") {
    l = net::unix_listen(listen);
  } else {
    l = net::tcp_listen(listen, 0);
    if (l) {
      std::printf("listening %u\n", static_cast<unsigned>(net::local_port(l->get()).value()));
      std::fflush(stdout);
    }
  }
  if (!l) return usage_error(l.error().message);
  std::optional<net::Endpoint> to;
  if (side == "source") {
    auto ep = net::parse_endpoint(peer, "--peer");
    if (!ep) return usage_error(ep.error().message);
    to = ep.value();
  }
  for (;;) {
    auto in = net::accept_for(l->get(), 24h);
    if (!in) continue;
    auto out = side == "source" ? net::tcp_connect(*to, 5s) : net::unix_connect(qemu, 5s);
    if (!out) {
      std::cerr << "rdmig-floor-relay: " << out.error().message << "\n";
      continue;  // `in` closes: QEMU sees its connection fail
    }
    if (side == "source") {
      net::tune_tcp_for_bulk(out->get());  // as the agents tune their data connections
    } else {
      net::tune_tcp_for_bulk(in->get());
    }
    std::thread(relay, std::move(in.value()), std::move(out.value()), chunk, splice).detach();
  }
}
