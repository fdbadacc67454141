// One process's measured spans as a record another process can read: how process 0 writes
// one trace of a job whose replicas run in many processes (docs/formats.md, "Job traces").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/simulator.h"

namespace conveyor::trace {

/// `spans` (seconds from a step's start) with that start on the host's wall clock, as text.
std::string span_record(const std::vector<scheduler::Span>& spans, std::int64_t wall_start_ns);

/// The spans of every record on one time line: seconds from the earliest record's start,
/// each record shifted by how much later its own step started (wall clocks: exact for the
/// processes of one host, as good as the clocks' agreement across hosts). A record that does
/// not parse, or holds a span that does not fit `ranks` pipeline ranks, is an error naming
/// the record's index.
Result<std::vector<scheduler::Span>> merge_span_records(const std::vector<std::string>& records, int ranks);

}  // namespace conveyor::trace
