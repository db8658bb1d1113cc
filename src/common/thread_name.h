// Names the calling thread (as `top -H`, `ps -L`, perf and gdb show it): the data path's threads
// say what they carry, e.g. "rdmig-s-up-3" for the source pump reading QEMU's connection 3.
#pragma once

#include <pthread.h>

#include <string>

namespace rdmig {

// Linux keeps 15 bytes of a thread's name; longer names are cut there.
inline void name_this_thread(std::string name) {
  if (name.size() > 15) name.resize(15);
  (void)::pthread_setname_np(::pthread_self(), name.c_str());
}

}  // namespace rdmig
