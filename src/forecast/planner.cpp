#include "forecast/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

namespace rdmig::forecast {

namespace {

bool converges_at(const PlanJob& job, uint32_t k) { return k >= 1 && k <= job.duration.size() && job.duration[k - 1] > 0; }

}  // namespace

uint32_t level_of(const PlanJob& job, uint32_t max_concurrency) {
  for (uint32_t k = std::min<uint32_t>(max_concurrency, static_cast<uint32_t>(job.duration.size())); k >= 1; --k) {
    if (converges_at(job, k)) return k;
  }
  return 0;
}

double lpt_makespan(const std::vector<double>& durations, uint32_t k, std::vector<double>* starts) {
  std::vector<size_t> idx(durations.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return durations[a] > durations[b]; });
  std::vector<double> slots(std::max<uint32_t>(k, 1), 0.0);
  if (starts) starts->assign(durations.size(), 0.0);
  for (size_t i : idx) {
    auto slot = std::min_element(slots.begin(), slots.end());
    if (starts) (*starts)[i] = *slot;
    *slot += durations[i];
  }
  return *std::max_element(slots.begin(), slots.end());
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Local search runs on drains of at most this many VMs (each sweep costs n * phases * K LPTs).
constexpr size_t kLocalSearchJobs = 64;
constexpr int kLocalSearchMoves = 1000;

struct Phase {
  uint32_t k = 1;
  std::vector<size_t> members;
};

class PhasePlanner {
 public:
  PhasePlanner(const std::vector<PlanJob>& jobs, uint32_t max_k) : jobs_(jobs), max_k_(max_k) {}

  // The phase's LPT makespan at k; infinity when a member does not converge at k.
  double span(const std::vector<size_t>& members, uint32_t k) const {
    std::vector<double> d;
    d.reserve(members.size());
    for (size_t job : members) {
      if (!converges_at(jobs_[job], k)) return kInf;
      d.push_back(jobs_[job].duration[k - 1]);
    }
    return lpt_makespan(d, k);
  }
  // The best k for `members` and its makespan.
  std::pair<uint32_t, double> best(const std::vector<size_t>& members) const {
    std::pair<uint32_t, double> out{1, members.empty() ? 0.0 : kInf};
    if (members.empty()) return out;
    for (uint32_t k = 1; k <= max_k_; ++k) {
      const double c = span(members, k);
      if (c < out.second) out = {k, c};
    }
    return out;
  }
  // Groups in order; phases cover contiguous runs of groups (dynamic programming).
  std::vector<Phase> contiguous(const std::vector<std::vector<size_t>>& groups) const {
    const size_t m = groups.size();
    std::vector<double> cost(m + 1, kInf);
    std::vector<size_t> from(m + 1, 0);
    std::vector<uint32_t> with_k(m + 1, 1);
    cost[0] = 0;
    for (size_t j = 1; j <= m; ++j) {
      std::vector<size_t> members;
      for (size_t i = j; i-- > 0;) {  // the phase [i, j), growing leftwards
        members.insert(members.end(), groups[i].begin(), groups[i].end());
        if (cost[i] == kInf) continue;
        const auto [k, c] = best(members);
        if (cost[i] + c < cost[j]) cost[j] = cost[i] + c, from[j] = i, with_k[j] = k;
      }
    }
    std::vector<Phase> phases;
    for (size_t j = m; j > 0; j = from[j]) {
      Phase ph{with_k[j], {}};
      for (size_t g = from[j]; g < j; ++g) ph.members.insert(ph.members.end(), groups[g].begin(), groups[g].end());
      phases.push_back(std::move(ph));
    }
    std::reverse(phases.begin(), phases.end());
    return phases;
  }
  double total(const std::vector<Phase>& phases) const {
    double t = 0;
    for (const auto& ph : phases) t += span(ph.members, ph.k);
    return t;
  }
  // Moves single jobs to another phase (or a phase of their own) while a move shortens the drain:
  // first improvement, at most kLocalSearchMoves moves.
  void improve(std::vector<Phase>& phases) const {
    for (int moves = 0; moves < kLocalSearchMoves && move_one(phases); ++moves) {
      std::erase_if(phases, [](const Phase& ph) { return ph.members.empty(); });
    }
  }

 private:
  bool move_one(std::vector<Phase>& phases) const {
    for (size_t from = 0; from < phases.size(); ++from) {
      const double before_from = span(phases[from].members, phases[from].k);
      for (size_t pos = 0; pos < phases[from].members.size(); ++pos) {
        std::vector<size_t> rest = phases[from].members;
        const size_t job = rest[pos];
        rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(pos));
        const auto after_from = best(rest);
        for (size_t to = 0; to <= phases.size(); ++to) {
          if (to == from) continue;
          std::vector<size_t> grown = to < phases.size() ? phases[to].members : std::vector<size_t>{};
          grown.push_back(job);
          const double before_to = to < phases.size() ? span(phases[to].members, phases[to].k) : 0;
          const auto after_to = best(grown);
          if (after_from.second + after_to.second >= before_from + before_to - 1e-9) continue;
          phases[from] = Phase{after_from.first, std::move(rest)};
          if (to < phases.size()) phases[to] = Phase{after_to.first, std::move(grown)};
          else phases.push_back(Phase{after_to.first, std::move(grown)});
          return true;
        }
      }
    }
    return false;
  }

  const std::vector<PlanJob>& jobs_;
  const uint32_t max_k_;
};

// argmin over converging k of d(k) / k: the path time a job costs per slot.
uint32_t efficient_k(const PlanJob& job, uint32_t max_k) {
  uint32_t out = 0;
  double best = kInf;
  for (uint32_t k = 1; k <= std::min<uint32_t>(max_k, static_cast<uint32_t>(job.duration.size())); ++k) {
    if (converges_at(job, k) && job.duration[k - 1] / k < best) best = job.duration[k - 1] / k, out = k;
  }
  return out;
}

}  // namespace

Plan plan(const std::vector<PlanJob>& jobs, uint32_t max_concurrency) {
  max_concurrency = std::max<uint32_t>(max_concurrency, 1);
  Plan out;
  std::map<uint32_t, std::vector<size_t>> by_level, by_efficiency;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const uint32_t level = level_of(jobs[j], max_concurrency);
    if (level == 0) {
      out.unplanned.push_back(j);
      continue;
    }
    by_level[level].push_back(j);
    by_efficiency[efficient_k(jobs[j], max_concurrency)].push_back(j);
  }
  PhasePlanner planner(jobs, max_concurrency);
  auto groups_of = [](const std::map<uint32_t, std::vector<size_t>>& m) {
    std::vector<std::vector<size_t>> g;
    for (const auto& [key, members] : m) g.push_back(members);
    return g;
  };
  std::vector<Phase> phases = planner.contiguous(groups_of(by_level));
  if (auto other = planner.contiguous(groups_of(by_efficiency)); planner.total(other) < planner.total(phases)) {
    phases = std::move(other);
  }
  size_t planned = 0;
  for (const auto& ph : phases) planned += ph.members.size();
  if (planned <= kLocalSearchJobs) planner.improve(phases);
  // Lay the phases out in time, the lowest concurrency first.
  std::stable_sort(phases.begin(), phases.end(), [](const Phase& a, const Phase& b) { return a.k < b.k; });
  double t = 0;
  uint32_t phase_no = 0;
  for (const auto& ph : phases) {
    std::vector<double> d;
    for (size_t job : ph.members) d.push_back(jobs[job].duration[ph.k - 1]);
    std::vector<double> starts;
    const double span = lpt_makespan(d, ph.k, &starts);
    std::vector<PlannedJob> laid;
    for (size_t n = 0; n < ph.members.size(); ++n) {
      laid.push_back(PlannedJob{ph.members[n], phase_no, ph.k, t + starts[n], t + starts[n] + d[n]});
    }
    std::stable_sort(laid.begin(), laid.end(), [](const PlannedJob& a, const PlannedJob& b) {
      return a.start < b.start || (a.start == b.start && a.end > b.end);  // longest first at a tie
    });
    out.order.insert(out.order.end(), laid.begin(), laid.end());
    t += span;
    ++phase_no;
  }
  out.makespan = t;
  return out;
}

}  // namespace rdmig::forecast
