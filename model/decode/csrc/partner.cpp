// The partner thread (partner.h says what it is for).
#include "partner.h"

#include <chrono>

namespace tserve_native {
namespace {

void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

Partner::Partner() : thread_([this] { loop(); }) {}

Partner::~Partner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Partner::run(int64_t n, const std::function<void(int64_t)>& chunk) {
  if (n <= 0) return;
  TORCH_CHECK(n < 0xffff, "at most 65,534 chunks per handoff");
  task_.store(&chunk, std::memory_order_relaxed);
  chunks_.store(n, std::memory_order_relaxed);
  // The state word: ticket (high 32 bits), next unclaimed chunk (16 bits), chunks the
  // partner is running (low 16 bits). A new ticket starts only once the last one's chunks
  // are all done, so the partner can never claim a chunk of an old task.
  ticket_ = (ticket_ + 1) & 0xffffffffu;
  state_.store(ticket_ << 32, std::memory_order_release);
  // seq_cst on posted_ and sleeping_: the partner sets sleeping_ then reads posted_, this reads
  // them the other way round, so one of the two always sees the other's write (no lost wake-up).
  posted_.fetch_add(1);
  if (sleeping_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_one();
  }
  int64_t c;
  while ((c = claim(false)) >= 0) chunk(c);
  // Every chunk is claimed: wait for the ones the partner is running (spin, then yield: a
  // partner woken onto this core runs only when this thread lets it).
  for (int spins = 0; (state_.load(std::memory_order_acquire) & 0xffffu) != 0; ++spins) {
    if (spins < 4096)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  // Closed: the next chunk past any count. A partner still holding this ticket must not read
  // the next task's chunk count (written before its ticket is) against this ticket's word
  // and claim a chunk this task does not have.
  state_.store((ticket_ << 32) | (uint64_t{0xffff} << 16), std::memory_order_release);
}

// The next chunk of the current ticket (and, for the partner, one more chunk running), or -1.
int64_t Partner::claim(bool partner) {
  uint64_t s = state_.load(std::memory_order_acquire);
  while (true) {
    const int64_t next = static_cast<int64_t>((s >> 16) & 0xffffu);
    if ((s >> 32) != ticket_seen(partner) || next >= chunks_.load(std::memory_order_relaxed)) return -1;
    const uint64_t want = s + (uint64_t{1} << 16) + (partner ? 1u : 0u);
    if (state_.compare_exchange_weak(s, want, std::memory_order_acq_rel)) return next;
  }
}

// Its kernels run inline: a task only comes during a step of one intra-op thread, so the
// thread count this thread takes on its first parallel call (torch reads it once per thread)
// is 1.
void Partner::loop() {
  uint64_t seen = 0;
  while (true) {
    // Spin a little for the next piece of the same step, then sleep until the next step.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (posted_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
      cpu_relax();
    if (posted_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.store(true);
      wake_.wait(lock, [&] { return stop_ || posted_.load() != seen; });
      sleeping_.store(false);
      if (stop_) return;
    }
    seen = posted_.load(std::memory_order_acquire);
    // The ticket of the task posted last; if the step's thread has moved on since, its state
    // word carries a newer ticket and nothing is claimed here.
    partner_ticket_ = state_.load(std::memory_order_acquire) >> 32;
    const std::function<void(int64_t)>* task = task_.load(std::memory_order_relaxed);
    int64_t c;
    while ((c = claim(true)) >= 0) {
      (*task)(c);
      state_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

}  // namespace tserve_native
