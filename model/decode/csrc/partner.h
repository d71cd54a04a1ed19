// A second thread for steps of a few rows, and over_rows, which shares a row-wise pass with it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "common.h"

namespace tserve_native {

// Under a passive OpenMP wait policy a step of a few rows runs on one intra-op thread
// (model/decode/threads.py: waking sleeping OpenMP threads for each of a step's hundreds of small
// regions cost more than it gained), which leaves half the memory bandwidth of a 2-core host
// unused at batch 1. This thread shares each projection and the attention of a step: the work
// comes as numbered chunks (a projection's halves or tiles, attention items), and both threads
// claim the next unclaimed chunk until none is left. The step's thread never waits for a partner
// that is asleep or not scheduled: it takes every chunk the partner has not claimed, and waits
// only for chunks the partner is running. Which thread runs a chunk changes no bit: a chunk is a
// set of whole outputs. The partner spins briefly between the pieces of a step and sleeps on a
// condition variable between steps, so the event loop has the core while the engine does its
// Python work.
class Partner {
 public:
  Partner();
  ~Partner();

  // chunk(c) for c in [0, n), shared with the partner thread; returns when all are done.
  void run(int64_t n, const std::function<void(int64_t)>& chunk);

 private:
  int64_t claim(bool partner);
  uint64_t ticket_seen(bool partner) const { return partner ? partner_ticket_ : ticket_; }
  void loop();

  std::atomic<const std::function<void(int64_t)>*> task_{nullptr};  // written before the state word (release)
  std::atomic<int64_t> chunks_{0};
  uint64_t ticket_ = 0;  // the step's thread's
  uint64_t partner_ticket_ = 0;  // the partner's copy
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> posted_{0};
  std::atomic<bool> sleeping_{false};
  bool stop_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;  // last: started once every member above is initialised
};

// fn(b0, b1) over rows [0, B) in pieces of at least ~16k values (`per_row` values a row): shared
// with `partner` where there is one and torch runs on one thread (a step's own work), else over
// torch's threads. A decode step's few rows stay in one piece, on this thread; a prompt's hundreds
// of rows are split, so the partner is not idle through the step's row-wise passes (norms, RoPE,
// activations, quantizing). Each row's arithmetic is the same whichever thread runs it.
template <typename F>
void over_rows(Partner* partner, int64_t B, int64_t per_row, const F& fn) {
  const int64_t rows_per = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(per_row, 1));
  if (partner != nullptr && at::get_num_threads() == 1) {
    if (B <= rows_per) return fn(0, B);
    const int64_t pieces = std::min<int64_t>((B + rows_per - 1) / rows_per, 64);
    const int64_t per = (B + pieces - 1) / pieces;
    partner->run((B + per - 1) / per, [&](int64_t c) { fn(c * per, std::min(B, (c + 1) * per)); });
    return;
  }
  at::parallel_for(0, B, rows_per, fn);
}

}  // namespace tserve_native
