// What the transport's native collectives share (native_sum.cc over shared memory,
// native_exchange.cc over TCP): the control block that binds an op to one transport
// (native_control.py owns it), its abort word and message, its stats and its flight
// recorder, and the clocks and atomics they are kept with.
#ifndef TF_DISTRIB_TRANSPORT_NATIVE_CONTROL_H_
#define TF_DISTRIB_TRANSPORT_NATIVE_CONTROL_H_

#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"

namespace tf_distrib {

// The control block's int64 words (native_control.py): the abort word, the peer waited
// for (its rank + 1, 0 for none), the stats (nanoseconds in collectives, collectives,
// bytes, nanoseconds waiting for peers), the wake pipe's writing end, the recorder's count.
constexpr int kAbort = 0, kWaitingFor = 1, kNanoseconds = 2, kCollectives = 3, kBytes = 4,
              kWakeFd = 5, kRecorded = 6, kWaitedNanoseconds = 7;
constexpr int kMessageOffset = 64, kMessageBytes = 960;
// The flight recorder: a ring of the last collectives, each (number, bytes, started,
// ended: 0 until it succeeds), wall-clock nanoseconds, after the abort message.
constexpr int kRecorderWord = 128, kRecorderEntries = 64, kEntryWords = 4;
// The first word after the recorder (an op's own words follow).
constexpr int kControlWords = kRecorderWord + kRecorderEntries * kEntryWords;

inline int64_t Nanoseconds(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}
inline int64_t Now() { return Nanoseconds(CLOCK_MONOTONIC); }

inline int64_t Load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void Store(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The abort's error (its message names the cause), or OK while there is none. The error
// is UNKNOWN, as a numpy_function's exception is (TensorFlow rewrites UNAVAILABLE from ops
// that are not its own communication ops into a message that drops the cause).
inline ::tensorflow::Status Aborted(const int64_t* control) {
  if (!Load(control + kAbort)) return ::tensorflow::OkStatus();
  const char* message = reinterpret_cast<const char*>(control) + kMessageOffset;
  return ::tensorflow::errors::Unknown(std::string(message, strnlen(message, kMessageBytes)));
}

// Wakes the watcher thread (a full pipe has woken it already: the result does not matter).
inline void Wake(const int64_t* control) {
  const char byte = 1;
  [[maybe_unused]] const ssize_t sent = write(static_cast<int>(Load(control + kWakeFd)), &byte, 1);
}

// One collective in the flight recorder and the stats: recorded when made, counted by
// `Done` once it succeeded. Only one op of a transport writes the recorder at a time (a
// transport's collectives run one at a time); the entry is complete before the count
// that shows it.
class Recorded {
 public:
  Recorded(int64_t* control, int64_t number, int64_t bytes)
      : control_(control), bytes_(bytes), began_(Now()) {
    const int64_t recorded = Load(control + kRecorded);
    entry_ = control + kRecorderWord + recorded % kRecorderEntries * kEntryWords;
    entry_[0] = number;
    entry_[1] = bytes;
    entry_[2] = Nanoseconds(CLOCK_REALTIME);
    entry_[3] = 0;
    Store(control + kRecorded, recorded + 1);
  }

  void Done() {
    Store(entry_ + 3, Nanoseconds(CLOCK_REALTIME));
    __atomic_add_fetch(control_ + kNanoseconds, Now() - began_, __ATOMIC_RELAXED);
    // The first wakes the watcher, which tells the launcher this worker trains.
    if (__atomic_add_fetch(control_ + kCollectives, 1, __ATOMIC_RELAXED) == 1) Wake(control_);
    __atomic_add_fetch(control_ + kBytes, bytes_, __ATOMIC_RELAXED);
  }

 private:
  int64_t* control_;
  int64_t* entry_;
  int64_t bytes_, began_;
};

}  // namespace tf_distrib

#endif  // TF_DISTRIB_TRANSPORT_NATIVE_CONTROL_H_
