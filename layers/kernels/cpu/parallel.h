// Work split over XLA's CPU thread pool, shared by the kernels of this library: `run` is called
// once per item, the items claimed in order by the calling thread and up to `threads - 1` pool
// threads as each frees up; returns when every item is done.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace zoo_cpu {

template <class Item, class Run>
void parallel(xla::ffi::ThreadPool& pool, int64_t threads, const std::vector<Item>& items,
              const Run& run) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  const int64_t total = static_cast<int64_t>(items.size());
  auto work = [state, total, &items, &run]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < total;) {
      run(items[i]);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    // The task may start after this call returned: it holds the state and finds no item left
    // before it would touch `items` or `run`.
    pool.Schedule([state, total, work]() {
      if (state->next.load() < total) work();
    });
  }
  work();
  while (state->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace zoo_cpu
