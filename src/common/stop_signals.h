// The signals that stop a daemon of this project (SIGTERM from the kubelet, SIGINT by hand), for
// one thread to sigwait: blocked in the calling thread, so in every thread it starts afterwards
// (call it before any thread starts). SIGPIPE is ignored: a peer that closed is an error return.
#pragma once

#include <signal.h>

namespace rdmig {

sigset_t block_stop_signals();

}  // namespace rdmig
