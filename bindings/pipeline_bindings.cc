// conveyor._C: PipelineStep, a pipelined training step in this process (and its part of a job),
// and the trace writer it and conveyor.distributed write through.
#include "bindings/bindings.h"

#include <optional>
#include <tuple>

#include "partitioner/planner.h"
#include "runtime/memory_meter.h"
#include "runtime/pipeline_step.h"
#include "trace/perfetto.h"

namespace conveyor::bindings {

using namespace conveyor::graph;

namespace {

// What run and run_packed return: (loss, measured seconds, actions timed), made without the
// GIL (pybind casts it once the GIL is held again).
std::tuple<at::Tensor, double, std::size_t> step_summary(const runtime::StepResult& r) {
  return {r.loss, r.measured.step_time_s, r.measured.spans.size()};
}

}  // namespace

void bind_pipeline(py::module_& m) {
  // The host memory one piece of work allocates through torch's CPU allocator (the profile's
  // working memory of a unit on the CPU, as torch.cuda.max_memory_allocated is on CUDA).
  struct HostMeter {
    std::shared_ptr<runtime::MemoryCounter> counter = std::make_shared<runtime::MemoryCounter>();
    std::unique_ptr<runtime::MeterScope> scope;
  };
  py::class_<HostMeter>(m, "HostMemoryMeter",
                        "with HostMemoryMeter() as meter: what this thread allocates through torch's CPU allocator "
                        "inside the block is charged to meter until freed (live, peak). Counts nothing when "
                        "HostMemoryMeter.active() is False.")
      .def(py::init([] {
        runtime::install_memory_meter();
        return HostMeter{};
      }))
      .def("__enter__", [](HostMeter& h) -> HostMeter& {
        if (!h.scope) h.scope = std::make_unique<runtime::MeterScope>(h.counter);
        return h;
      }, py::return_value_policy::reference)
      .def("__exit__", [](HostMeter& h, const py::args&) { h.scope.reset(); })
      .def_property_readonly("live", [](const HostMeter& h) { return h.counter->live(); },
                             "Bytes allocated inside the block and not yet freed.")
      .def_property_readonly("peak", [](const HostMeter& h) { return h.counter->peak(); },
                             "The most bytes live at once since the meter was made or reset_peak.")
      .def("reset_peak", [](HostMeter& h) { h.counter->reset_peak(); }, "The peak from now on starts at live.")
      .def_static("active", &runtime::memory_meter_active,
                  "Whether torch's CPU allocations go through the meter (CONVEYOR_MEMORY_METER=0 turns it off).");
  py::class_<trace::PerfettoTrace>(m, "PerfettoTrace",
                                   "A trace being built (trace/perfetto.h): tracks, slices (times in ns), instants and "
                                   "flows joining slices that carry the same id.")
      .def(py::init<>())
      .def("add_track", &trace::PerfettoTrace::add_track, py::arg("name"), py::arg("parent") = 0,
           "Declares a track (a row); returns its id. parent: a track it nests under.")
      .def("slice", &trace::PerfettoTrace::slice, py::arg("track"), py::arg("start_ns"), py::arg("end_ns"),
           py::arg("name"), py::arg("flows") = std::vector<std::uint64_t>{})
      .def("instant", &trace::PerfettoTrace::instant, py::arg("track"), py::arg("t_ns"), py::arg("name"))
      .def("write", [](const trace::PerfettoTrace& t, const std::string& path) { check(t.write(path)); },
           py::arg("path"), "Chrome JSON where path ends in .json, a Perfetto protobuf trace otherwise.");
  m.def("host_waits", &runtime::host_waits,
        "How many times this process's pipelines made the host wait for a device (docs/thread_model.md: once a step).");
  py::class_<runtime::HeldGradients, std::shared_ptr<runtime::HeldGradients>>(
      m, "HeldGradients", "The gradients one step held back from .grad until its loss's backward.")
      .def("apply", [](runtime::HeldGradients& held, const at::Tensor& scale) {
        py::gil_scoped_release nogil;
        held.apply(scale);
      }, py::arg("scale"), "Adds them, times scale (the loss's incoming gradient), into .grad; once.");

  py::class_<runtime::PipelineStep>(m, "PipelineStep",
                                    "One pipelined training step over stages of a graph, in this process.")
      .def(py::init([](const std::shared_ptr<GraphExecutor>& ex, std::vector<std::vector<NodeId>> stages,
                       const std::string& schedule, int microbatches, int chunks, std::vector<int> replicas,
                       std::int64_t bucket_bytes, int intra_op_threads, const std::shared_ptr<PlanHandle>& plan,
                       std::shared_ptr<runtime::ProcessGroup> processes, std::vector<int> rank_process,
                       double step_timeout_s, std::vector<std::vector<int>> replica_process,
                       std::optional<std::uint64_t> seed, const std::string& transport, std::vector<std::string> recompute,
                       std::vector<std::vector<double>> shares, std::map<std::string, std::vector<int>> holders) {
             scheduler::ScheduleSpec spec;
             spec.kind = unwrap(scheduler::schedule_kind_from_name(schedule));
             spec.chunks = chunks;
             spec.ranks = static_cast<int>(stages.size()) / std::max(chunks, 1);
             spec.microbatches = microbatches;
             runtime::PipelineOptions options;
             // The plan this pipeline runs: its simulated step (simulated once per plan) is the live
             // profile's reference.
             if (plan) options.predicted = plan->prediction_for(spec);
             options.replicas = std::move(replicas);
             options.shares = std::move(shares);
             options.holders = std::move(holders);
             if (bucket_bytes > 0) options.bucket_bytes = bucket_bytes;
             options.intra_op_threads = intra_op_threads;
             options.processes = std::move(processes);
             options.rank_process = std::move(rank_process);
             options.replica_process = std::move(replica_process);
             if (step_timeout_s > 0) {
               options.step_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(step_timeout_s * 1000));
             }
             options.seed = seed;
             options.interrupted = python_signal_raised;  // Ctrl-C fails a step (and a job across processes)
             for (const std::string& r : recompute) {
               auto mode = recomputation_from_name(r);
               if (!mode) {
                 check(Status(ErrorCode::kInvalidArgument,
                              "recompute \"" + r + "\" (expected " + recomputation_names_text() + ")"));
               }
               options.recompute.push_back(*mode);
             }
             if (transport == "nccl") {
               options.transport = runtime::PipelineOptions::Transport::kNccl;
             } else if (transport != "ucx") {
               check(Status(ErrorCode::kInvalidArgument, "transport \"" + transport + "\" (expected \"ucx\" or \"nccl\")"));
             }
             py::gil_scoped_release nogil;  // with processes, creation talks to the others
             return unwrap(runtime::PipelineStep::create(ex, std::move(stages), spec, std::move(options)));
           }),
           py::arg("executor"), py::arg("stages"), py::arg("schedule") = "1f1b", py::arg("microbatches") = 1,
           py::arg("chunks") = 1, py::arg("replicas") = std::vector<int>{}, py::arg("bucket_bytes") = 0,
           py::arg("intra_op_threads") = 0, py::arg("plan") = nullptr, py::arg("processes") = nullptr,
           py::arg("rank_process") = std::vector<int>{}, py::arg("step_timeout_s") = 0.0,
           py::arg("replica_process") = std::vector<std::vector<int>>{}, py::arg("seed") = py::none(),
           py::arg("transport") = "ucx", py::arg("recompute") = std::vector<std::string>{},
           py::arg("shares") = std::vector<std::vector<double>>{},
           py::arg("holders") = std::map<std::string, std::vector<int>>{},
           "replicas: per rank (empty: one each); shares: per rank, each replica's weight in splitting a "
           "microbatch (empty: even); holders: a re-plan's {tensor name: processes holding it} (the old "
           "pipeline's readers()): each process receives only what its stages read and lacks, and releases the "
           "rest at the first step (empty: every tensor from its owner to every process); bucket_bytes: gradient reduction bucket size (0: 4 MiB); "
           "intra_op_threads: torch threads per replica (0: the caller's shared out); plan: the Plan the stages "
           "come from (its simulated step is what the live profile compares against); processes, "
           "rank_process: run across the job's processes, pipeline rank r on process rank_process[r]; "
           "replica_process: the same per replica, replica i of rank r on process replica_process[r][i] (a stage "
           "whose replicas run in several processes sums its gradients across them); "
           "step_timeout_s: a step that takes longer fails (0: 10 minutes); seed: random operators (dropout) "
           "of each forward draw from a generator seeded from it, the step, the stage, the microbatch and the "
           "replica (None: drawn from torch's global generator now; across processes, process 0's); transport: how "
           "activations and gradients cross between processes, \"ucx\" (host memory) or \"nccl\" (GPU memory, "
           "one GPU per process); recompute: per stage, \"none\", \"full\" (keep only its inputs between forward and "
           "backward and run its forward again before the backward) or \"selective\" (run its cheap operators "
           "again: activation recomputation).")
      .def("gather_state", [](runtime::PipelineStep& step) {
        py::gil_scoped_release nogil;
        check(step.gather_state());
      }, "Many processes: every parameter and buffer becomes its owner's, whole, on every process (collective; "
         "the next step releases what this process's stages do not read).")
      .def("set_draws", &runtime::PipelineStep::set_draws, py::arg("seed"), py::arg("next_step"),
           "The next step's random draws: the job's seed and the step's number in the job.")
      .def("owners", [](const runtime::PipelineStep& step) {
        py::dict out;
        for (const auto& [name, process] : step.owners()) out[py::str(name)] = process;
        return out;
      }, "Many processes: {parameter or buffer name: the process that owns it} (empty in one process).")
      .def("readers", &runtime::PipelineStep::readers,
           "Many processes: {parameter or buffer name: the processes whose stages read it} (empty in one process).")
      .def("handed_over_bytes", &runtime::PipelineStep::handed_over_bytes,
           "The bytes of parameters and buffers this process received when made from holders (a re-plan).")
      .def("handed_over_s", &runtime::PipelineStep::handed_over_s,
           "How long receiving and sending them took, in seconds.")
      .def("share_lengths", &runtime::PipelineStep::share_lengths, py::arg("stage"), py::arg("length"),
           "The samples each replica of `stage` runs of a microbatch of `length` (its rank's shares; empty for "
           "a stage the pipeline lacks).")
      .def_property_readonly("loss_reduction", [](const runtime::PipelineStep& step) {
        const auto& found = step.loss_reduction();
        return py::make_tuple(runtime::loss_reduction_name(found.reduction), found.why);
      }, "(how, why): how the loss combines the samples, \"mean\" (a share weighs its samples over the batch's), "
         "\"sum\" (a share weighs 1) or \"other\" (weighed as a mean; `why` names the operator).")
      .def(
          "run",
          [](runtime::PipelineStep& step, const py::sequence& inputs, double grad_scale, bool hold_gradients) {
            std::vector<c10::IValue> values;
            for (auto h : inputs) values.push_back(to_ivalue(h));
            py::gil_scoped_release nogil;
            return step_summary(unwrap(step.run(values, grad_scale, hold_gradients)));
          },
          py::arg("inputs"), py::arg("grad_scale") = 1.0, py::arg("hold_gradients") = false,
          "Runs every microbatch forward and backward; returns (loss, measured seconds, actions timed). Gradients "
          "reach .grad times grad_scale; with hold_gradients they are held, and .grad keeps what it had, until "
          "take_held_gradients.")
      .def(
          "evaluate",
          [](runtime::PipelineStep& step, const py::sequence& inputs) {
            std::vector<c10::IValue> values;
            for (auto h : inputs) values.push_back(to_ivalue(h));
            py::gil_scoped_release nogil;
            return step_summary(unwrap(step.evaluate(values)));
          },
          py::arg("inputs"),
          "Runs every microbatch forward only (an evaluation: no_grad, nothing kept for a backward, no gradient "
          "touched) on the same stages, replicas and processes; returns (loss, measured seconds, actions timed).")
      .def(
          "run_packed",
          [](runtime::PipelineStep& step, const py::sequence& microbatches, double grad_scale, bool hold_gradients) {
            std::vector<std::vector<c10::IValue>> packed;
            for (auto mb : microbatches) {
              std::vector<c10::IValue> values;
              for (auto h : py::reinterpret_borrow<py::sequence>(mb)) values.push_back(to_ivalue(h));
              packed.push_back(std::move(values));
            }
            py::gil_scoped_release nogil;
            return step_summary(unwrap(step.run_packed(packed, grad_scale, hold_gradients)));
          },
          py::arg("microbatches"), py::arg("grad_scale") = 1.0, py::arg("hold_gradients") = false,
          "run over microbatches packed by the caller (one list of flattened inputs each, as many as the pipeline "
          "runs; each with its own samples and symbolic sizes, its loss weighed by its samples over the step's).")
      .def("take_held_gradients", &runtime::PipelineStep::take_held_gradients,
           "The gradients the last run held (hold_gradients=True): each run holds its own until applied.")
      .def("take_input_gradients", [](runtime::PipelineStep& step) {
        py::list out;
        for (const at::Tensor& g : step.take_input_gradients()) out.append(g.defined() ? py::cast(g) : py::none());
        return out;
      }, "The last run's gradient of each graph input that required one (the whole batch's; None for the others), "
         "taken.")
      .def("write_trace", [](const runtime::PipelineStep& step, const std::string& path,
                             const std::vector<std::pair<double, std::string>>& markers) {
        std::vector<trace::Marker> marks;
        for (const auto& [t, name] : markers) marks.push_back({t, name});
        check(step.write_trace(path, marks));
      }, py::arg("path"), py::arg("markers") = std::vector<std::pair<double, std::string>>{},
         "Writes the last step's measured actions as a Perfetto trace; markers: (seconds from the step's start, "
         "name) instant events (a switch of plan).")
      .def("trace_record", &runtime::PipelineStep::trace_record,
           "The last step's measured spans of this process, with the step's start on the wall clock (bytes for "
           "process 0 to merge with write_job_trace).")
      .def("write_job_trace", [](const runtime::PipelineStep& step, const std::string& path,
                                 const std::vector<std::string>& records,
                                 const std::vector<std::pair<double, std::string>>& markers) {
        std::vector<trace::Marker> marks;
        for (const auto& [t, name] : markers) marks.push_back({t, name});
        check(step.write_job_trace(path, records, marks));
      }, py::arg("path"), py::arg("records"), py::arg("markers") = std::vector<std::pair<double, std::string>>{},
         "Writes one trace of the job's last step from every process's trace_record(): every replica's tracks, "
         "flows from each send to its consumer across processes.")
      .def("set_prediction", [](runtime::PipelineStep& step, const PlanHandle& plan) {
        step.set_prediction(plan.prediction_for(step.spec()));
      }, py::arg("plan"), "From now on the live profile compares the steps that follow with this plan's prediction "
         "(the running plan priced again on corrected inputs).")
      .def("spans", [](const runtime::PipelineStep& step) {
        py::list out;
        for (const auto& s : step.last_step().spans) {
          static const char* streams[] = {"compute", "send", "collective", "across processes",
                                          "waiting for processes"};
          py::dict d;
          d["rank"] = s.rank;
          d["replica"] = s.replica;
          d["stream"] = streams[static_cast<int>(s.stream)];
          d["action"] = scheduler::action_text(s.action);
          d["stage"] = s.action.stage;
          d["microbatch"] = s.action.microbatch;
          d["start_s"] = s.start_s;
          d["end_s"] = s.end_s;
          out.append(std::move(d));
        }
        return out;
      }, "The last step's measured actions: rank, replica, stream, action, stage, microbatch, start_s, end_s "
         "(seconds from the step's start; on CUDA the device's times).")
      .def("last_reduction", &runtime::PipelineStep::last_reduction,
           "(buckets, reduced during backward) of the last step's gradient reduction across replicas.")
      .def("stages_of_rank", [](const runtime::PipelineStep& step, int rank) { return step.spec().stages_of_rank(rank); },
           py::arg("rank"), "The stages pipeline rank `rank` holds (the schedule's placement: one, round-robin "
           "chunks, or ZB-V's two in a V).")
      .def("memory_peaks", &runtime::PipelineStep::memory_peaks,
           "{(rank, replica): bytes} for the replicas of this process: the most host memory each one's compute "
           "held at once during the last step (torch's CPU allocator: activations, gradients, working memory; "
           "not the parameters and optimizer state it found); empty when it cannot be counted.")
      .def("profile_report", [](const runtime::PipelineStep& step) {
        runtime::ProfileReport r;
        {
          py::gil_scoped_release nogil;
          r = unwrap(step.profile_report());
        }
        py::list stages;
        for (const auto& s : r.stages) {
          py::dict d;
          d["stage"] = s.stage;
          d["rank"] = s.rank;
          d["replicas"] = s.replicas;
          const std::pair<const char*, std::pair<double, double>> times[] = {  // (measured, predicted)
              {"forward_s", {s.forward_s, s.predicted_forward_s}},
              {"backward_s", {s.backward_s, s.predicted_backward_s}},
              {"backward_weight_s", {s.backward_weight_s, s.predicted_backward_weight_s}},
              {"send_s", {s.send_s, s.predicted_send_s}},
              {"allreduce_s", {s.allreduce_s, s.predicted_allreduce_s}}};
          for (const auto& [name, measured_predicted] : times) {
            d[name] = measured_predicted.first;
            d[py::str(std::string("predicted_") + name)] = measured_predicted.second;
          }
          d["across_s"] = s.across_s;
          d["waiting_s"] = s.waiting_s;
          d["compute_ratio"] = s.compute_ratio();
          d["replica_compute_s"] = s.replica_compute_s;
          stages.append(d);
        }
        py::dict out;
        out["steps"] = r.steps;
        out["measured_step_s"] = r.measured_step_s;
        out["predicted_step_s"] = r.predicted_step_s;
        out["stages"] = stages;
        out["table"] = r.table();
        return out;
      }, "The live profile: every step's measured actions against the plan's prediction, per stage.");

}

}  // namespace conveyor::bindings
