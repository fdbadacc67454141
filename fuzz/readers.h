// Every file reader conveyor has, behind one name each: what the fuzz targets feed mutated
// bytes to (fuzz/fuzz_target.cc, built by `./run fuzz` with libFuzzer and ASan/UBSan) and
// what the ordinary suite replays every crash ever found against (tests/fuzz).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::fuzz {

/// The readers by name: graph_file, graph_document, op_graph, profile, cluster, job_config,
/// plan, trace; and what else reads bytes an attacker chooses: command_line (the `conveyor`
/// command's arguments, NUL-separated) and rendezvous_join (frames sent to process 0's
/// rendezvous port).
const std::vector<std::string>& reader_names();

/// Reads `bytes` as `reader` would read a file, then uses what it read the way conveyor does
/// next (writes it back, prints a plan's table): a Status either way, never a crash.
Status read_as(std::string_view reader, std::string_view bytes);

}  // namespace conveyor::fuzz
