// conveyor._C: the graph IR, the graph file format, the executor and planning.
#include "bindings/bindings.h"

#include <chrono>
#include <optional>

#include "common/printable.h"
#include "common/recomputation.h"
#include "graph/executor.h"
#include "graph/format.h"
#include "graph/partition.h"
#include "partitioner/planner.h"
#include "partitioner/replan.h"
#include "runtime/batch_layout.h"
#include "scheduler/schedule.h"

namespace conveyor::bindings {

using namespace conveyor::graph;

namespace {

partitioner::CostGraph cost_graph_of(const PyGraph& g, const std::string& profile_json) {
  auto profile = unwrap(partitioner::Profile::from_json(profile_json));
  return unwrap(partitioner::cost_graph_from_profile(g.graph, profile));
}

// `recompute`: a recomputation's name fixes every stage's; none leaves it to the planner.
partitioner::PlanOptions plan_options(int batch, int microbatches, const std::vector<std::string>& schedules,
                                      double optimizer_state, int max_replicas, int max_microbatches,
                                      bool even_shares, int ranks, const std::vector<int>& replicas, int chunks,
                                      const std::optional<std::string>& recompute = std::nullopt) {
  partitioner::PlanOptions o;
  if (recompute) {
    o.recompute = recomputation_from_name(*recompute);
    if (!o.recompute) {
      raise(Status(ErrorCode::kInvalidArgument, "recompute \"" + *recompute + "\" (expected " +
                                                    recomputation_names_text() +
                                                    " for every stage, or None: the planner chooses per stage)"));
    }
  }
  o.ranks = ranks;
  o.replicas = replicas;
  o.chunks = chunks;
  o.batch = batch;
  o.microbatches = microbatches;
  o.optimizer_bytes_per_param_byte = optimizer_state;
  o.max_replicas = max_replicas;
  if (max_microbatches > 0) o.max_microbatches = max_microbatches;
  o.even_shares = even_shares;
  for (const auto& name : schedules) o.schedules.push_back(unwrap(scheduler::schedule_kind_from_name(name)));
  return o;
}

TensorBlob blob_of(const std::string& name, const at::Tensor& tensor) {
  at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
  TensorBlob b;
  b.name = name;
  b.dtype = scalar_type_name(t.scalar_type());
  b.shape.assign(t.sizes().begin(), t.sizes().end());
  b.bytes.assign(static_cast<const char*>(t.data_ptr()), t.nbytes());
  return b;
}

at::Tensor tensor_of(const TensorBlob& b) {
  auto type = unwrap(scalar_type_from_name(b.dtype));
  at::Tensor t = at::empty(b.shape, at::TensorOptions().dtype(type));
  if (t.nbytes() != b.bytes.size()) {
    raise(Status(ErrorCode::kCorrupt, "tensor '" + b.name + "' has " + std::to_string(b.bytes.size()) +
                                          " bytes, its shape and dtype need " + std::to_string(t.nbytes())));
  }
  std::memcpy(t.data_ptr(), b.bytes.data(), b.bytes.size());
  return t;
}

}  // namespace

void bind_graph(py::module_& m) {
  py::class_<PyGraph>(m, "GraphIR", "A validated conveyor graph (structure only, no tensors).")
      .def(py::init([](const std::string& text) { return PyGraph{unwrap(Graph::from_json(text))}; }),
           py::arg("json"))
      .def("to_json", [](const PyGraph& g) { return g.graph.to_json(); })
      .def_property_readonly("num_nodes", [](const PyGraph& g) { return g.graph.nodes.size(); })
      .def_property_readonly("num_values", [](const PyGraph& g) { return g.graph.values.size(); })
      .def("atomic_groups", [](const PyGraph& g) { return atomic_groups(g.graph); })
      .def("loss_reduction", [](const PyGraph& g) -> std::optional<py::tuple> {
        std::vector<NodeId> all(g.graph.nodes.size());
        for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<NodeId>(i);
        auto layout = runtime::BatchLayout::analyze(g.graph, {all}, {1});
        if (!layout.is_ok()) return std::nullopt;
        const auto& found = layout.value().loss_reduction;
        return py::make_tuple(runtime::loss_reduction_name(found.reduction), found.why);
      }, "(how, why) as PipelineStep.loss_reduction, for the graph whole; None where it returns no scalar loss.")
      .def("check_stage", [](const PyGraph& g, const std::vector<NodeId>& nodes) {
        check(check_stage(g.graph, nodes));
      })
      .def("check_partition", [](const PyGraph& g, const Stages& stages) {
        check(check_partition(g.graph, stages));
      })
      .def("stage_boundary", [](const PyGraph& g, const std::vector<NodeId>& nodes) {
        auto b = stage_boundary(g.graph, nodes);
        return py::make_tuple(b.inputs, b.outputs);
      })
      .def("random_partition",
           [](const PyGraph& g, int num_stages, std::uint64_t seed, bool keep_node_order) {
             return unwrap(random_partition(g.graph, num_stages, seed, keep_node_order));
           },
           py::arg("num_stages"), py::arg("seed") = 0, py::arg("keep_node_order") = false);

  m.def("save_graph_file",
        [](const std::string& path, const PyGraph& g, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
          std::vector<TensorBlob> blobs;
          blobs.reserve(tensors.size());
          for (const auto& [name, t] : tensors) blobs.push_back(blob_of(name, t));
          py::gil_scoped_release nogil;
          check(save_graph_file(path, g.graph, blobs));
        },
        py::arg("path"), py::arg("graph"), py::arg("tensors"));

  m.def("load_graph_file", [](const std::string& path) {
    GraphFile file;
    {
      py::gil_scoped_release nogil;
      file = unwrap(load_graph_file(path));
    }
    py::list tensors;
    for (const auto& b : file.tensors) tensors.append(py::make_tuple(b.name, tensor_of(b)));
    return py::make_tuple(PyGraph{std::move(file.graph)}, tensors);
  });

  py::class_<StageActivation>(m, "StageActivation", "What a stage keeps from forward for backward.")
      .def_property_readonly("outputs", [](const StageActivation& a) { return to_py_list(a.outputs); });

  py::class_<StageProgram, std::shared_ptr<StageProgram>>(m, "StageProgram",
                                                          "A compiled convex set of nodes.")
      .def_property_readonly("nodes", &StageProgram::nodes)
      .def_property_readonly("inputs", &StageProgram::inputs)
      .def_property_readonly("outputs", &StageProgram::outputs)
      .def("forward", [](const StageProgram& s, const py::sequence& inputs, std::optional<std::uint64_t> seed) {
        auto values = to_ivalues(inputs);
        py::gil_scoped_release nogil;
        return unwrap(s.forward(std::move(values), seed));
      }, py::arg("inputs"), py::arg("seed") = py::none(),
      "Runs the stage; with seed, its random operators draw from generators seeded with it.")
      .def("forward_selective", [](const StageProgram& s, const py::sequence& inputs, std::optional<std::uint64_t> seed) {
        auto values = to_ivalues(inputs);
        py::gil_scoped_release nogil;
        return unwrap(s.forward_selective(std::move(values), seed));
      }, py::arg("inputs"), py::arg("seed") = py::none(),
      "Runs the stage keeping only what selective recomputation keeps: its cheap operators run again "
      "in the backward.")
      .def_property_readonly("selective_runs", [](const StageProgram& s) {
        py::list out;
        for (const auto& run : s.selective_runs()) out.append(py::make_tuple(run.nodes, run.inputs));
        return out;
      }, "The runs forward_selective recomputes in the backward: (nodes, the values each keeps in their stead).")
      .def("backward", [](const StageProgram& s, StageActivation& act, const py::sequence& grads) {
        auto values = to_ivalues(grads);
        std::vector<c10::IValue> out;
        {
          py::gil_scoped_release nogil;
          out = unwrap(s.backward(act, std::move(values)));
        }
        return to_py_list(out);
      });

  py::class_<GraphExecutor, std::shared_ptr<GraphExecutor>>(m, "GraphExecutor",
                                                            "Runs a graph or its stages through the dispatcher.")
      .def(py::init([](const PyGraph& g, const std::unordered_map<std::string, at::Tensor>& tensors) {
             TensorMap map(tensors.begin(), tensors.end());
             return unwrap(GraphExecutor::create(g.graph, std::move(map)));
           }),
           py::arg("graph"), py::arg("tensors"))
      .def("unseeded_random_nodes", &GraphExecutor::unseeded_random_nodes,
           "Nodes that draw random numbers but take no seeded generator (they draw from torch's global one).")
      .def("check_inputs", [](const GraphExecutor& ex, const py::sequence& inputs) {
        check(ex.check_inputs(to_ivalues(inputs)));
      }, py::arg("inputs"),
         "Checks a call's flattened inputs against the capture (count, fixed sizes, dtypes, one size per symbol, "
         "the model's device, the batch range) without running anything; raises naming what differs.")
      .def("run", [](const GraphExecutor& ex, const py::sequence& inputs) {
        auto values = to_ivalues(inputs);
        std::vector<c10::IValue> out;
        {
          py::gil_scoped_release nogil;
          out = unwrap(ex.run(std::move(values)));
        }
        return to_py_list(out);
      })
      .def("stage", [](const GraphExecutor& ex, std::vector<NodeId> nodes) {
        return std::const_pointer_cast<StageProgram>(unwrap(ex.stage(std::move(nodes))));
      });

  // The vocabularies Python checks its arguments against, spelled once in C++.
  m.def("printable", [](const std::string& text, std::size_t limit) { return printable(text, limit); },
        py::arg("text"), py::arg("limit") = 40,
        "What an error message may quote of an input: at most `limit` bytes (\"...\" marks the cut), bytes that "
        "are not printable ASCII as '?' (common/printable.h: the one function for it, C++ and Python).");
  m.def("schedule_names", [] {
        std::vector<std::string> names;
        for (auto kind : scheduler::kScheduleKinds) names.emplace_back(scheduler::schedule_kind_name(kind));
        return names;
      },
      "Every schedule's name (scheduler/schedule.h), in the order they are listed to users.");
  m.def("chunks_of", [](const std::string& schedule) {
        return scheduler::default_chunks(unwrap(scheduler::schedule_kind_from_name(schedule)));
      },
      py::arg("schedule"),
      "The stages each pipeline rank holds under a schedule when nothing else fixes it: 2 for interleaved and the "
      "V shapes (zb-v, dualpipev), else 1.");
  m.def("stages_of_rank", [](const std::string& schedule, int ranks, int chunks, int rank) {
        scheduler::ScheduleSpec spec;
        spec.kind = unwrap(scheduler::schedule_kind_from_name(schedule));
        spec.ranks = ranks;
        spec.chunks = chunks;
        return spec.stages_of_rank(rank);
      },
      py::arg("schedule"), py::arg("ranks"), py::arg("chunks"), py::arg("rank"),
      "The stages pipeline rank `rank` runs under a schedule of `ranks` ranks and `chunks` stages each, "
      "ascending (round-robin, or down the ranks and back up for the V shapes).");
  m.def("recomputation_names", [] {
        std::vector<std::string> names;
        for (auto r : kRecomputations) names.emplace_back(recomputation_name(r));
        return names;
      },
      "Every activation recomputation's name (common/recomputation.h): none, selective, full.");

  // Planning (torch-free C++ behind it): profiles and clusters in as documents, plans out as
  // handles (a plan is parsed, and simulated, once; JSON is only its file and wire format).
  py::class_<PlanHandle, std::shared_ptr<PlanHandle>>(
      m, "Plan",
      "A plan made by the planner or read from a plan document (docs/formats.md), unchanged from then on; "
      "PipelineStep(plan=...) and set_prediction take it, and its simulated step is simulated once, when first asked.")
      .def("to_json", [](const PlanHandle& p) { return p.plan().to_json(); },
           "The plan document (docs/formats.md, \"Plan document\"): its file and wire format.")
      .def_property_readonly("table", [](const PlanHandle& p) { return p.plan().table(); },
                             "The readable table `conveyor plan` prints.")
      .def_property_readonly("stage_nodes", [](const PlanHandle& p) {
        std::vector<std::vector<int>> out;
        for (const auto& s : p.plan().stages) out.push_back(s.ops);
        return out;
      }, "Each stage's node ids.")
      .def_property_readonly("replicas", [](const PlanHandle& p) {
        std::vector<int> out;
        for (const auto& s : p.plan().stages) out.push_back(s.replicas);
        return out;
      }, "Each stage's replicas.")
      .def_property_readonly("schedule", [](const PlanHandle& p) {
        return std::string(scheduler::schedule_kind_name(p.plan().schedule));
      })
      .def_property_readonly("microbatches", [](const PlanHandle& p) { return p.plan().microbatches; })
      .def_property_readonly("chunks", [](const PlanHandle& p) { return p.plan().chunks; },
                             "Stages per pipeline rank (2: interleaved, ZB-V, DualPipeV).")
      .def_property_readonly("predicted_step_s", [](const PlanHandle& p) { return p.plan().predicted_step_s; },
                             "The simulated step time the planner found.");
  m.def("graph_hash", [](const PyGraph& g) { return partitioner::graph_hash(g.graph); },
        "The hash profiles are keyed by.");
  const auto cluster_summary = [](const partitioner::Cluster& cluster) {
    py::dict out;
    out["name"] = cluster.name;
    out["nodes"] = cluster.nodes;
    out["devices"] = cluster.devices.size();
    double memory = 0;
    for (const auto& d : cluster.devices) memory = std::max(memory, d.memory_bytes);
    out["largest_device_memory_bytes"] = memory;
    return out;
  };
  m.def(
      "read_cluster",
      [cluster_summary](const std::string& cluster_toml, const std::string& source) {
        return cluster_summary(unwrap(partitioner::Cluster::from_toml(cluster_toml, source)));
      },
      py::arg("cluster"), py::arg("source"),
      "Checks a cluster's TOML text (errors name `source` and the line); returns its name, nodes, devices and "
      "its largest device's memory.");
  m.def(
      "read_cluster_file",
      [cluster_summary](const std::string& path) { return cluster_summary(unwrap(partitioner::load_cluster(path))); },
      py::arg("path"),
      "read_cluster of a cluster file, read as every text file is (its size limit: docs/formats.md).");
  m.def(
      "plan",
      [](const PyGraph& g, const std::string& profile_json, const std::string& cluster_toml, int batch,
         int microbatches, const std::vector<std::string>& schedules, double optimizer_state, int max_replicas,
         int max_microbatches, bool even_shares, int ranks, const std::vector<int>& replicas, int chunks,
         const std::optional<std::string>& recompute) {
        auto costs = cost_graph_of(g, profile_json);
        auto cluster = unwrap(partitioner::Cluster::from_toml(cluster_toml, "cluster"));
        auto o = plan_options(batch, microbatches, schedules, optimizer_state, max_replicas, max_microbatches, even_shares,
                              ranks, replicas, chunks, recompute);
        partitioner::Plan plan;
        {
          py::gil_scoped_release nogil;
          plan = unwrap(partitioner::make_plan(costs, cluster, o));
        }
        return std::make_shared<PlanHandle>(std::move(plan));
      },
      py::arg("graph"), py::arg("profile"), py::arg("cluster"), py::arg("batch"), py::arg("microbatches") = 0,
      py::arg("schedules") = std::vector<std::string>{}, py::arg("optimizer_state") = 2.0, py::arg("max_replicas") = 0,
      py::arg("max_microbatches") = 0, py::arg("even_shares") = false, py::arg("ranks") = 0,
      py::arg("replicas") = std::vector<int>{}, py::arg("chunks") = 0, py::arg("recompute") = py::none(),
      "Plans a captured graph from its profile on a cluster (TOML text); returns a Plan. even_shares: "
      "replicas split microbatches evenly, as the runtime does (off: in proportion to their devices' speeds). "
      "ranks, replicas (one count, or one per rank) and chunks fix those parts (0 or empty: planned); recompute: "
      "None (the planner chooses per stage: a stage recomputes its activations where it would not fit "
      "otherwise, selectively where that fits, else fully), or a name of _C.recomputation_names() for every "
      "stage: \"none\", \"selective\" (its cheap operators) or \"full\" (its whole forward).");

  m.def(
      "read_plan",
      [](const std::string& plan_json) {
        return std::make_shared<PlanHandle>(unwrap(partitioner::Plan::from_json(plan_json)));
      },
      py::arg("plan"), "A Plan from a plan document (a file's or the wire's text), checked as conveyor's planner "
      "reads it.");

  m.def(
      "plan_stages",
      [](const PyGraph& g, const std::string& profile_json, const std::string& cluster_toml,
         const std::vector<std::vector<int>>& stages, const std::vector<int>& replicas, int batch, int microbatches,
         const std::string& schedule, double optimizer_state, bool even_shares) {
        auto costs = cost_graph_of(g, profile_json);
        auto cluster = unwrap(partitioner::Cluster::from_toml(cluster_toml, "cluster"));
        auto o = plan_options(batch, microbatches, {schedule}, optimizer_state, 0, 0, even_shares, 0, {}, 0);
        partitioner::Candidate c{stages, replicas, microbatches, unwrap(scheduler::schedule_kind_from_name(schedule))};
        return std::make_shared<PlanHandle>(unwrap(partitioner::plan_candidate(costs, cluster, o, c)));
      },
      py::arg("graph"), py::arg("profile"), py::arg("cluster"), py::arg("stages"), py::arg("replicas"),
      py::arg("batch"), py::arg("microbatches"), py::arg("schedule") = "1f1b", py::arg("optimizer_state") = 2.0,
      py::arg("even_shares") = true,
      "Prices a given split (node lists, replicas per stage) on the planner's model: a Plan with its objective "
      "and simulated step, as `plan` would give it.");

  py::class_<partitioner::Replanner>(m, "Replanner",
                                     "Decides, window after window, whether a running plan should give way to "
                                     "another (partitioner/replan.h).")
      .def(py::init([](const PyGraph& g, const std::string& profile_json, const std::string& cluster_toml,
                       const PlanHandle& running, int batch, int microbatches,
                       const std::vector<std::string>& schedules, double optimizer_state, int max_replicas,
                       int max_microbatches, int ranks, const std::vector<int>& replicas, int chunks,
                       const std::optional<std::string>& recompute, int horizon_steps, bool moves_bytes, double min_gain, double margin, int confirmations,
                       double tolerance, bool probes_each_device) {
             partitioner::ReplanPolicy policy;
             policy.horizon_steps = horizon_steps;
             policy.moves_bytes = moves_bytes;
             policy.min_gain = min_gain;
             policy.margin = margin;
             policy.confirmations = confirmations;
             policy.tolerance = tolerance;
             policy.probes_each_device = probes_each_device;
             return partitioner::Replanner(
                 cost_graph_of(g, profile_json), unwrap(partitioner::Cluster::from_toml(cluster_toml, "cluster")),
                 running.plan(),
                 plan_options(batch, microbatches, schedules, optimizer_state, max_replicas, max_microbatches, false,
                              ranks, replicas, chunks, recompute),
                 policy);
           }),
           py::arg("graph"), py::arg("profile"), py::arg("cluster"), py::arg("plan"), py::arg("batch"),
           py::arg("microbatches") = 0, py::arg("schedules") = std::vector<std::string>{},
           py::arg("optimizer_state") = 2.0, py::arg("max_replicas") = 0, py::arg("max_microbatches") = 0,
           py::arg("ranks") = 0, py::arg("replicas") = std::vector<int>{}, py::arg("chunks") = 0,
           py::arg("recompute") = py::none(), py::arg("horizon_steps") = 100, py::arg("moves_bytes") = true, py::arg("min_gain") = 0.1,
           py::arg("margin") = 0.5, py::arg("confirmations") = 2, py::arg("tolerance") = 0.1,
           py::arg("probes_each_device") = true,
           "The planning inputs of `plan` (made from graph, profile and cluster with the same options, its fixed "
           "parts included; replicas share microbatches by their devices' speeds, in whole samples) and the policy: the horizon in steps, whether stages moving moves bytes between "
           "processes, the least relative gain, the margin over the moving cost, the confirmations, the noise "
           "tolerance, and whether each device is probed on its own (a process per device).")
      .def("evaluate", [](partitioner::Replanner& r, const py::list& stages, double measured_step_s, double rebuild_s,
                          double bytes_per_s, bool may_search, const std::vector<double>& probe_rate,
                          const std::vector<double>& optimizer_s, double host_s, double caller_step_s) {
        std::vector<partitioner::StageMeasurement> measured;
        for (auto item : stages) {
          auto d = item.cast<py::dict>();
          partitioner::StageMeasurement m;
          m.forward_s = d["forward_s"].cast<double>();
          m.backward_s = d["backward_s"].cast<double>();
          m.backward_weight_s = d["backward_weight_s"].cast<double>();
          if (d.contains("replica_compute_s")) m.replica_compute_s = d["replica_compute_s"].cast<std::vector<double>>();
          if (d.contains("send_s")) m.send_s = d["send_s"].cast<double>();
          if (d.contains("allreduce_s")) m.allreduce_s = d["allreduce_s"].cast<double>();
          measured.push_back(std::move(m));
        }
        r.policy().rebuild_s = rebuild_s;
        r.policy().bytes_per_s = bytes_per_s;
        partitioner::ReplanDecision d;
        {
          py::gil_scoped_release nogil;
          d = unwrap(r.evaluate(measured, measured_step_s, may_search, probe_rate,
                                partitioner::BeyondPipeline{optimizer_s, host_s, caller_step_s}));
        }
        const auto& f = d.calibration.factors;
        const std::vector<double> stage_pricing = r.stage_pricing(d.calibration.running);
        py::dict out;
        out["switch"] = d.switch_plan;
        out["undo"] = d.undo;
        out["reason"] = d.reason;
        out["arithmetic"] = d.arithmetic(r.policy());
        out["candidate_table"] = d.candidate.table();
        out["running_predicted_step_s"] = d.calibration.running.predicted_step_s;
        out["candidate"] = std::make_shared<PlanHandle>(std::move(d.candidate));
        out["running"] = std::make_shared<PlanHandle>(std::move(d.calibration.running));
        out["measured_step_s"] = d.measured_step_s;
        out["predicted_step_s"] = d.predicted_step_s;
        out["gain_s"] = d.gain_s;
        out["gain_asked"] = d.gain_asked;
        out["move_bytes"] = d.move.bytes;
        out["move_s"] = d.move.seconds();
        out["transfer_s"] = d.move.transfer_s;
        out["rebuild_s"] = d.move.rebuild_s;
        out["confirmations"] = d.confirmations;
        out["searched"] = d.searched;
        out["search_deferred"] = d.search_deferred;
        out["shape_only"] = d.shape_only;
        out["action_overhead_s"] = d.action_overhead_s;
        out["optimizer_s_per_param_byte"] = d.optimizer_s_per_param_byte;
        out["host_s"] = d.host_s;
        out["speed_ceiling"] = d.speed_ceiling;
        out["census_owed"] = d.census_owed;
        out["census_why"] = d.census_why;
        out["reprobe_owed"] = d.reprobe_owed;
        out["factors"] = py::dict(py::arg("forward") = f.forward, py::arg("backward") = f.backward,
                                  py::arg("weight") = f.weight, py::arg("speed") = f.speed, py::arg("link") = f.link,
                                  py::arg("stage_pricing") = stage_pricing,
                                  py::arg("unpriced") = r.unpriced());
        return out;
      }, py::arg("stages"), py::arg("measured_step_s"), py::arg("rebuild_s") = 0.0, py::arg("bytes_per_s") = 0.0,
         py::arg("may_search") = true, py::arg("probe_rate") = std::vector<double>{},
         py::arg("optimizer_s") = std::vector<double>{}, py::arg("host_s") = 0.0, py::arg("caller_step_s") = 0.0,
         "One window of the running plan (the live profile's stages, merged across processes, and its mean step "
         "with the optimizer's: what plans price): corrects the inputs, plans again and decides; optimizer_s: per "
         "device its process's optimizer step per step (empty: not measured); host_s: per step what no plan "
         "changes, added to the measured and predicted steps alike; caller_step_s: the window's mean step as the "
         "caller measured it, which judges a switch (0: not measured) (partitioner/replan.h, BeyondPipeline); rebuild_s and bytes_per_s: what building a pipeline and "
         "moving bytes measured (0: unknown / the cluster's links); may_search False: only a search owed runs; "
         "probe_rate: per device, its probe's matrix products per second at the window's end (0: not probed; every "
         "device probed: a census) (partitioner/replan.h). Returns a dict: switch, reason, arithmetic, "
         "candidate (a Plan) and candidate_table, running (a Plan: the running plan priced on the corrected inputs), "
         "the step times, the gain, the moving cost and the factors.")
      .def("switched_to", [](partitioner::Replanner& r, const PlanHandle& plan, double step_before_s) {
             check(r.switched_to(plan.plan(), step_before_s));
           },
           py::arg("plan"), py::arg("step_before_s") = 0.0,
           "The Plan that runs from now on; step_before_s: the last window's mean step before it, as the caller "
           "measured it, which judges a switch the Replanner decided (0: its deciding window's).");
  m.def("matrix_product_rate", [](const std::string& device, double seconds, std::int64_t side) {
          if (!(seconds > 0 && seconds <= 10) || side < 1) {
            throw py::value_error("matrix_product_rate: seconds must be in (0, 10] and side positive");
          }
          py::gil_scoped_release nogil;  // timed without the interpreter: another thread holding it is not the device
          at::Tensor a = at::ones({side, side}, at::TensorOptions().device(c10::Device(device)));
          at::Tensor b = at::empty_like(a);
          a.sum().item<float>();  // the device's queue drained: only the products are timed
          using clock = std::chrono::steady_clock;
          const auto t0 = clock::now();
          std::int64_t done = 0, chunk = 1;
          double elapsed = 0;
          while (elapsed < seconds) {  // chunks waited for (a GPU's queue), growing until each takes 1 ms
            const auto c0 = clock::now();
            for (std::int64_t i = 0; i < chunk; ++i) at::mm_out(b, a, a);
            b.sum().item<float>();
            done += chunk;
            if (std::chrono::duration<double>(clock::now() - c0).count() < 1e-3) chunk *= 2;
            elapsed = std::chrono::duration<double>(clock::now() - t0).count();
          }
          return static_cast<double>(done) / elapsed;
        },
        py::arg("device"), py::arg("seconds"), py::arg("side"),
        "Products of two side x side float matrices per second on `device` (\"cpu\", \"cuda:0\"), run for "
        "`seconds` of wall time without holding the interpreter: re-planning's probe of a device no stage runs on.");
}

}  // namespace conveyor::bindings
