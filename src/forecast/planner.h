// The drain planner: in which order, and how many at once, a node's VMs migrate so that the
// drain ends soonest without any VM breaking its downtime limit.
//
// Each VM j has a duration d_j(k) when k migrations share its path (model.h: B_k), or none when
// it does not converge within its limits at that share. Running more at once helps while one
// migration cannot fill the path (too few channels, window-bound) and hurts once it can (each
// pass is slower, so more is dirtied and resent, and some VMs stop converging).
//
// A plan is a sequence of phases; a phase runs its VMs k at a time (each VM converging at k),
// in longest-first order (LPT: the next VM starts on the slot that frees first), and the next
// phase starts when the last VM of the one before ends. The planner groups the VMs twice: by the
// highest k at which each still converges (its level), and by the k at which it costs the path
// least (argmin d(k) / k); for each grouping it chooses by dynamic programming which contiguous
// runs of groups share a phase and the best k of each; it keeps the shorter, then (drains of up
// to 64 VMs) moves single VMs between phases while that shortens the drain. Each phase is LPT,
// within 4/3 - 1/(3k) of the best schedule of its VMs at that k (Graham 1969);
// tests/unit/forecast_test.cpp compares whole plans against an exhaustive search (every
// partition into phases, every k, every assignment to slots): on 5000 cases of 2 to 7 VMs the
// planner was optimal in 4898 and at most 10.6% longer. Durations are taken at the phase's k for
// the whole migration (a VM that ends early does not speed up the others), so the predicted
// drain time errs long. VMs that converge at no concurrency are left out and listed apart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rdmig::forecast {

struct PlanJob {
  std::string name;
  // duration[k - 1]: seconds with k migrations on the path at once; <= 0 or absent: does not
  // converge within its limits at k.
  std::vector<double> duration;
};

struct PlannedJob {
  size_t job = 0;        // index into the input
  uint32_t phase = 0;
  uint32_t concurrency = 0;  // k of its phase
  double start = 0, end = 0; // seconds from the drain's start
};

struct Plan {
  std::vector<PlannedJob> order;   // in start order
  std::vector<size_t> unplanned;   // jobs that converge at no concurrency, input order
  double makespan = 0;             // seconds, the predicted drain time
};

// max_concurrency: per node pair, at least 1.
Plan plan(const std::vector<PlanJob>& jobs, uint32_t max_concurrency);

// Longest-first list schedule of `durations` on k slots: start times, in the input's order,
// and the makespan.
double lpt_makespan(const std::vector<double>& durations, uint32_t k, std::vector<double>* starts = nullptr);

// The highest k <= max_concurrency at which the job converges (its durations at 1..k may have
// gaps; only k itself counts); 0 when none.
uint32_t level_of(const PlanJob& job, uint32_t max_concurrency);

}  // namespace rdmig::forecast
