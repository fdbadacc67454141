// The messages between conveyor's actors (CAF: include only from the actors' own translation
// units, runtime/coordinator.cc, partitioner_actor.cc and rendezvous.cc). Local actors pass
// shared state by pointer; the types that will cross the wire between processes get
// inspect() overloads when the remote control plane lands.
#pragma once

#include <caf/all.hpp>
#include <memory>

#include "runtime/coordinator.h"
#include "runtime/step_run.h"

namespace conveyor::runtime {

using step_atom = caf::atom_constant<caf::atom("step")>;        // coordinator: run this step
using run_atom = caf::atom_constant<caf::atom("run")>;          // replica: walk your list of this step
using profile_atom = caf::atom_constant<caf::atom("profile")>;  // partitioner: a measured step
using report_atom = caf::atom_constant<caf::atom("report")>;    // partitioner: how far from the plan?
using predict_atom = caf::atom_constant<caf::atom("predict")>;  // partitioner: compare with this from now on

using StepPtr = std::shared_ptr<runtime::StepRun>;
using MeasuredPtr = std::shared_ptr<const runtime::RunResult>;
using PredictionPtr = std::shared_ptr<const scheduler::SimulationResult>;

/// The process's actor system, started on first use and never destroyed: a replica stuck in
/// a hook that never returns keeps its thread, and destroying the system would wait for it.
caf::actor_system& actor_system();

/// A StageReplica: a detached actor (a thread of its own for its whole life, so torch's
/// intra-op pools and a CUDA device binding persist across steps) that walks its replica's
/// action list of each step it is sent.
caf::behavior stage_replica(caf::event_based_actor* self, int rank, int replica);

/// The PartitionerActor: receives every measured step and reports how far the running plan
/// is from `predicted` (the simulator's spans for the plan; none: measured figures only).
caf::behavior partitioner_actor(caf::event_based_actor* self, scheduler::ScheduleSpec spec, std::vector<int> replicas,
                                std::shared_ptr<const scheduler::SimulationResult> predicted);

}  // namespace conveyor::runtime

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(conveyor::runtime::StepPtr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(conveyor::runtime::MeasuredPtr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(conveyor::runtime::PredictionPtr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(conveyor::runtime::ProfileReport)
