// LD_PRELOAD shim for ThreadSanitizer runs against Debian's prebuilt Abseil (tests/sanitizers.sh).
//
// absl::Mutex lives in libabsl_synchronization.so, which is not built with -fsanitize=thread:
// its lock and unlock are atomics and futex calls TSan cannot see, so every field guarded by
// an absl::Mutex would be reported as a race. This library interposes the exported
// absl::Mutex / CondVar entry points (Abseil 20220623, inline namespace "debian3"), calls the
// real ones (dlsym RTLD_NEXT) and tells TSan about the happens-before edges with
// __tsan_acquire / __tsan_release on the mutex's address: acquire after every lock (also
// after LockWhen*, Await*, CondVar::Wait*, which return holding it), release before every
// unlock (also before Await* and Wait*, which drop it while waiting).
//
// Conditions given to LockWhen*/Await* are wrapped so that their evaluation (inside Abseil,
// with the lock held) also counts as an acquire.
//
// Built by tests/sanitizers.sh with `g++ -shared -fPIC -ldl` (not instrumented itself);
// __tsan_acquire/__tsan_release are looked up at run time, so without TSan it does nothing
// but forward.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"

namespace {

using AnnotateFn = void (*)(void*);

AnnotateFn TsanFn(const char* name) {
  void* f = dlsym(RTLD_DEFAULT, name);
  return reinterpret_cast<AnnotateFn>(f);
}

void Acquire(void* mu) {
  static const AnnotateFn f = TsanFn("__tsan_acquire");
  if (f != nullptr) f(mu);
}

void Release(void* mu) {
  static const AnnotateFn f = TsanFn("__tsan_release");
  if (f != nullptr) f(mu);
}

template <typename Fn>
Fn Real(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found\n", name);
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

// A Condition is evaluated with the mutex held, inside Abseil (by the waiter, or by the thread
// unlocking): the wrapper tells TSan the lock is held before the caller's condition reads
// guarded state.
struct CondCtx {
  void* mu;
  const absl::Condition* cond;
};

// The evaluation is its own critical section: acquire before it, release after it. Without
// the release, a waiter's reads in a condition that came out false (it then sleeps, Abseil
// dropping the lock unseen by TSan) did not happen-before the next holder's writes, and TSan
// reported e.g. LocalTransport::Send racing with Recv's condition (a false positive).
bool EvalAcquiring(void* arg) {
  const CondCtx* c = static_cast<const CondCtx*>(arg);
  Acquire(c->mu);
  const bool r = c->cond->Eval();
  Release(c->mu);
  return r;
}

// Duration (int64 hi, uint32 lo) and Time (which holds one) are trivially copyable with GCC
// (Abseil's user-provided copy constructor is for old MSVC only), so the x86-64 ABI passes
// them by value in two registers: forwarded as a struct of the same layout. (Forwarding them
// as a pointer, as an earlier version did, dropped the low word: every AwaitWithDeadline /
// LockWhenWithTimeout under TSan returned at once, e.g. ring_test's deadline tests.)
struct TimeArg {
  int64_t hi;
  uint32_t lo;
};
static_assert(sizeof(TimeArg) == sizeof(absl::Duration), "layout of absl::Duration");
static_assert(sizeof(TimeArg) == sizeof(absl::Time), "layout of absl::Time");

}  // namespace

extern "C" {

void _ZN4absl7debian35Mutex4LockEv(void* mu) {
  static const auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex4LockEv");
  real(mu);
  Acquire(mu);
}

void _ZN4absl7debian35Mutex10ReaderLockEv(void* mu) {
  static const auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex10ReaderLockEv");
  real(mu);
  Acquire(mu);
}

void _ZN4absl7debian35Mutex6UnlockEv(void* mu) {
  static const auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex6UnlockEv");
  Release(mu);
  real(mu);
}

void _ZN4absl7debian35Mutex12ReaderUnlockEv(void* mu) {
  static const auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex12ReaderUnlockEv");
  Release(mu);
  real(mu);
}

bool _ZN4absl7debian35Mutex7TryLockEv(void* mu) {
  static const auto real = Real<bool (*)(void*)>("_ZN4absl7debian35Mutex7TryLockEv");
  const bool ok = real(mu);
  if (ok) Acquire(mu);
  return ok;
}

bool _ZN4absl7debian35Mutex13ReaderTryLockEv(void* mu) {
  static const auto real = Real<bool (*)(void*)>("_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const bool ok = real(mu);
  if (ok) Acquire(mu);
  return ok;
}

// LockWhen(cond) / ReaderLockWhen(cond): return holding the lock.
void _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(void* mu, const void* cond) {
  static const auto real =
      Real<void (*)(void*, const void*)>("_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  real(mu, &wrapped);
  Acquire(mu);
}

void _ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE(void* mu, const void* cond) {
  static const auto real = Real<void (*)(void*, const void*)>(
      "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  real(mu, &wrapped);
  Acquire(mu);
}

bool _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(void* mu,
                                                                                 const void* cond,
                                                                                 TimeArg d) {
  static const auto real = Real<bool (*)(void*, const void*, TimeArg)>(
      "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  const bool r = real(mu, &wrapped, d);
  Acquire(mu);
  return r;
}

bool _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(void* mu,
                                                                              const void* cond,
                                                                              TimeArg t) {
  static const auto real = Real<bool (*)(void*, const void*, TimeArg)>(
      "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  const bool r = real(mu, &wrapped, t);
  Acquire(mu);
  return r;
}

// Await(cond): drops the lock while waiting, returns holding it.
void _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(void* mu, const void* cond) {
  static const auto real =
      Real<void (*)(void*, const void*)>("_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  Release(mu);
  real(mu, &wrapped);
  Acquire(mu);
}

bool _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(void* mu,
                                                                              const void* cond,
                                                                              TimeArg d) {
  static const auto real = Real<bool (*)(void*, const void*, TimeArg)>(
      "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  Release(mu);
  const bool r = real(mu, &wrapped, d);
  Acquire(mu);
  return r;
}

bool _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(void* mu,
                                                                           const void* cond,
                                                                           TimeArg t) {
  static const auto real = Real<bool (*)(void*, const void*, TimeArg)>(
      "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const CondCtx ctx{mu, static_cast<const absl::Condition*>(cond)};
  const absl::Condition wrapped(&EvalAcquiring, const_cast<CondCtx*>(&ctx));
  Release(mu);
  const bool r = real(mu, &wrapped, t);
  Acquire(mu);
  return r;
}

// CondVar::Wait*(mu): drops mu while waiting, returns holding it.
void _ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(void* cv, void* mu) {
  static const auto real =
      Real<void (*)(void*, void*)>("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  real(cv, mu);
  Acquire(mu);
}

bool _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(void* cv, void* mu,
                                                                          TimeArg d) {
  static const auto real = Real<bool (*)(void*, void*, TimeArg)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  const bool r = real(cv, mu, d);
  Acquire(mu);
  return r;
}

bool _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE(void* cv, void* mu,
                                                                       TimeArg t) {
  static const auto real = Real<bool (*)(void*, void*, TimeArg)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  const bool r = real(cv, mu, t);
  Acquire(mu);
  return r;
}

// ReleasableMutexLock::Release(): unlocks its mutex (its first member).
void _ZN4absl7debian319ReleasableMutexLock7ReleaseEv(void* lock) {
  static const auto real = Real<void (*)(void*)>("_ZN4absl7debian319ReleasableMutexLock7ReleaseEv");
  Release(*static_cast<void**>(lock));
  real(lock);
}

}  // extern "C"
