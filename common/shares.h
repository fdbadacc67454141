// How a microbatch's samples are split between the replicas of a stage (torch-free): evenly,
// as tensor_split does, or weighted by the replicas' devices' speeds. The runtime slices by
// it and the planner prices by it, so both see the same integer shares.
#pragma once

#include <cstdint>
#include <vector>

namespace conveyor {

/// The samples [offset, offset + length) of a microbatch that one replica runs.
struct Share {
  std::int64_t offset = 0, length = 0;
};

/// The share of `length` samples that replica `i` of `replicas` takes (tensor_split's rule:
/// the first length % replicas replicas take one more).
Share share_of(std::int64_t length, int replicas, int i);

/// The samples each replica takes of `length` when replicas are weighted by `weights` (one
/// per replica, positive: its device's speed; empty or all equal: tensor_split's rule, as
/// share_of): the whole-sample split whose slowest share (length over weight) ends first,
/// every replica taking at least one sample when there are enough; ties to the lower index.
/// Sums to `length`.
std::vector<std::int64_t> share_lengths(std::int64_t length, const std::vector<double>& weights, int replicas);
/// Replica `i`'s share of `length` under `weights` (share_lengths, as offset and length).
Share share_of(std::int64_t length, const std::vector<double>& weights, int replicas, int i);

}  // namespace conveyor
