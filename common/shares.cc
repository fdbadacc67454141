#include "common/shares.h"

#include <algorithm>
#include <cmath>

namespace conveyor {

Share share_of(std::int64_t length, int replicas, int i) {
  const std::int64_t base = length / replicas, extra = length % replicas;
  return {i * base + std::min<std::int64_t>(i, extra), base + (i < extra ? 1 : 0)};
}

std::vector<std::int64_t> share_lengths(std::int64_t length, const std::vector<double>& weights, int replicas) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(replicas));
  const bool even = weights.size() != out.size() ||
                    std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights[0]; });
  if (even) {
    for (int i = 0; i < replicas; ++i) out[i] = share_of(length, replicas, i).length;
    return out;
  }
  double sum = 0;
  for (double w : weights) sum += w;
  // Minimize the slowest share (length over weight): start below every optimum (each at
  // least one sample, else the floor of its proportional quota), then give each further
  // sample where it ends soonest. Ties go to the lower index, so equal weights split as
  // tensor_split does.
  const std::int64_t least = length >= replicas ? 1 : 0;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double quota = static_cast<double>(length) * weights[i] / sum;
    out[i] = std::max(least, static_cast<std::int64_t>(std::floor(quota + 1e-9)));
    total += out[i];
  }
  auto later = [](double a, double b) { return a > b * (1 + 1e-12); };
  while (total > length) {  // raised to one sample: the slowest above one gives one back
    std::size_t worst = out.size();
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (out[i] <= least) continue;
      if (worst == out.size() || later(static_cast<double>(out[i]) / weights[i],
                                       static_cast<double>(out[worst]) / weights[worst])) {
        worst = i;
      }
    }
    --out[worst];
    --total;
  }
  while (total < length) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < out.size(); ++i) {
      if (later(static_cast<double>(out[best] + 1) / weights[best], static_cast<double>(out[i] + 1) / weights[i])) {
        best = i;
      }
    }
    ++out[best];
    ++total;
  }
  return out;
}

Share share_of(std::int64_t length, const std::vector<double>& weights, int replicas, int i) {
  if (weights.empty()) return share_of(length, replicas, i);
  const std::vector<std::int64_t> lengths = share_lengths(length, weights, replicas);
  Share s;
  for (int k = 0; k < i; ++k) s.offset += lengths[k];
  s.length = lengths[i];
  return s;
}

}  // namespace conveyor
