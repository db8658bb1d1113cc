// Clang's thread-safety analysis (-Wthread-safety): attributes that state which mutex guards
// which member and which lock a function needs, checked at compile time by Clang. Other
// compilers (GCC builds the agent) see nothing. The annotated mutex is rdmig::Mutex
// (common/mutex.h): libstdc++'s std::mutex carries no capability attribute.
//
//   Mutex mu_;
//   int count_ GUARDED_BY(mu_) = 0;              // read or written only with mu_ held
//   std::unique_ptr<T> p_ PT_GUARDED_BY(mu_);    // the pointee (not the pointer) needs mu_
//   void bump_locked() REQUIRES(mu_);            // the caller holds mu_
//   void bump() EXCLUDES(mu_);                   // the caller must not hold mu_ (it takes it)
//
// The check: tests/tsa/check.sh (ctest -R thread_safety) runs clang++ -fsyntax-only
// -Wthread-safety -Werror=thread-safety over every source that includes an annotated header.
#pragma once

#if defined(__clang__)
#define RDMIG_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define RDMIG_THREAD_ANNOTATION(x)
#endif

// Abseil's legacy absl/base/internal/thread_annotations.h (reached through gRPC's headers)
// defines five of these names, with the same attributes: whichever header comes first wins.
#define CAPABILITY(x) RDMIG_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY RDMIG_THREAD_ANNOTATION(scoped_lockable)
#ifndef GUARDED_BY
#define GUARDED_BY(x) RDMIG_THREAD_ANNOTATION(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) RDMIG_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) RDMIG_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) RDMIG_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#define REQUIRES(...) RDMIG_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) RDMIG_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) RDMIG_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) RDMIG_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) RDMIG_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) RDMIG_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) RDMIG_THREAD_ANNOTATION(lock_returned(x))
// Turns the analysis off for one function. Every use says why next to it.
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS RDMIG_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif
