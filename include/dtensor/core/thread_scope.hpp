#pragma once
// ThreadScope<Derived>: the base of a scope object that is, while it lives, this thread's innermost live
// Derived (CommDebugMode, CommWaitTimer, RingTrace): constructed, it shadows the one before it; destroyed,
// it restores it. Scopes nest as blocks do; each thread has its own chain.
//
//   class Recorder : public detail::ThreadScope<Recorder> { ... };
//   for (Recorder* r = Recorder::innermost(); r != nullptr; r = r->enclosing()) { ... }   // every live one

namespace dtensor::detail {

template <class Derived>
class ThreadScope {
public:
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

  /// The newest live scope of this thread; nullptr when none is.
  static Derived* innermost() noexcept { return static_cast<Derived*>(top()); }
  /// True when some scope is live on this thread (callers skip computing what they would record).
  static bool any_active() noexcept { return top() != nullptr; }
  /// The scope this one shadows; nullptr for the outermost.
  Derived* enclosing() const noexcept { return static_cast<Derived*>(enclosing_); }

protected:
  ThreadScope() noexcept : enclosing_(top()) { top() = this; }
  ~ThreadScope() { top() = enclosing_; }

private:
  // Held as the base, cast to Derived only once it is constructed.
  static ThreadScope*& top() noexcept {
    thread_local ThreadScope* current = nullptr;
    return current;
  }
  ThreadScope* enclosing_;
};

} // namespace dtensor::detail
