// The Python extension `conveyor._C`. The only place a Status becomes a Python exception
// (the classes live in conveyor/errors.py, looked up by error-code name).
#include <torch/extension.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "graph/executor.h"
#include "graph/format.h"
#include "graph/ir.h"
#include "graph/partition.h"
#include "partitioner/planner.h"
#include "runtime/pipeline_step.h"

namespace py = pybind11;
using namespace conveyor;
using namespace conveyor::graph;

namespace {

struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return status.message().c_str(); }
  Status status;
};

[[noreturn]] void raise(const Status& st) { throw StatusError(st); }
void check(const Status& st) {
  if (!st.is_ok()) raise(st);
}
template <typename T>
T unwrap(Result<T> r) {
  if (!r.is_ok()) raise(r.status());
  return std::move(r).value();
}

// A Python handle on an NCCL group member: each call waits for its operation (without the
// GIL) and aborts the group when it does not finish in time.
struct NcclHandle {
  std::shared_ptr<transport::NcclGroup> group;
  std::chrono::milliseconds timeout;
  void run(const std::string& what, const std::function<void(transport::Done)>& issue) const {
    py::gil_scoped_release nogil;
    std::optional<Status> done = transport::wait_within(issue, timeout);
    if (!done) {
      Status late(ErrorCode::kExecution, "NCCL " + what + " did not complete within " + std::to_string(timeout.count()) +
                                             " ms (a member that hangs or is gone); the group is aborted");
      group->abort(late);  // ends NCCL's kernels; the operation then completes with `late`
      check(late);
    }
    check(*done);
  }
};

c10::IValue to_ivalue(py::handle h) {
  if (h.is_none()) return {};
  if (THPVariable_Check(h.ptr())) return THPVariable_Unpack(h.ptr());
  if (PyBool_Check(h.ptr())) return h.cast<bool>();
  if (PyLong_Check(h.ptr())) return h.cast<std::int64_t>();
  if (PyFloat_Check(h.ptr())) return h.cast<double>();
  throw py::type_error("conveyor: expected a tensor, int, float, bool or None, got " +
                       std::string(py::str(py::type::handle_of(h))));
}

std::vector<c10::IValue> to_ivalues(const py::sequence& seq) {
  std::vector<c10::IValue> out;
  out.reserve(seq.size());
  for (auto item : seq) out.push_back(to_ivalue(item));
  return out;
}

py::object to_py(const c10::IValue& v) {
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isNone()) return py::none();
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isList()) {
    py::list l;
    for (const auto& item : v.toListRef()) l.append(to_py(item));
    return l;
  }
  throw py::type_error("conveyor: cannot convert value of type " + v.tagKind() + " to Python");
}

py::list to_py_list(const std::vector<c10::IValue>& values) {
  py::list l;
  for (const auto& v : values) l.append(to_py(v));
  return l;
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

// Torch-free graph structure, for planning and inspection without tensors.
struct PyGraph {
  Graph graph;
};

using Stages = std::vector<std::vector<NodeId>>;

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "conveyor's C++ core: graph IR, file format, executor";
  m.attr("GRAPH_FORMAT_VERSION") = kGraphFormatVersion;
  m.attr("CONTAINER_VERSION") = kContainerVersion;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::gil_scoped_acquire gil;
      py::object cls = py::module_::import("conveyor.errors")
                           .attr("error_class")(std::string(error_code_name(e.status.code())));
      PyErr_SetString(cls.ptr(), e.status.message().c_str());
    }
  });

  py::class_<PyGraph>(m, "GraphIR", "A validated conveyor graph (structure only, no tensors).")
      .def(py::init([](const std::string& text) { return PyGraph{unwrap(Graph::from_json(text))}; }),
           py::arg("json"))
      .def("to_json", [](const PyGraph& g) { return g.graph.to_json(); })
      .def_property_readonly("num_nodes", [](const PyGraph& g) { return g.graph.nodes.size(); })
      .def_property_readonly("num_values", [](const PyGraph& g) { return g.graph.values.size(); })
      .def("atomic_groups", [](const PyGraph& g) { return atomic_groups(g.graph); })
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

  m.def("ucx_status", [] {
    auto probe = transport::make_ucx_endpoint(0, 1);
    return probe.is_ok() ? std::string() : probe.status().message();
  }, "Empty when UCX can start here (processes can be connected); otherwise why not.");

  m.def("nccl_status", [] {
    auto described = transport::nccl_description();
    return py::make_tuple(described.is_ok(), described.is_ok() ? *described : described.status().message());
  }, "(True, 'NCCL 2.28.9 (path)') when NCCL can be loaded here (no GPU needed for that); (False, why not).");
  m.def("nccl_unique_id", [] {
    auto id = unwrap(transport::nccl_unique_id());
    return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  }, "A fresh unique id for a new NCCL group (128 bytes): one member makes it, every member passes it to NcclGroup.");

  py::class_<NcclHandle>(m, "NcclGroup",
                         "A member of an NCCL group on one CUDA device (transport/nccl.h): collectives on the member's "
                         "own stream, after the work queued on the current stream; each call returns once its result "
                         "is in the tensor. Joining fails when the other members have not joined within timeout_s; a call that "
                         "does not finish within timeout_s aborts the group.")
      .def(py::init([](int rank, int size, const py::bytes& unique_id, const std::string& device, double timeout_s) {
             std::string id = unique_id;
             auto dev = c10::Device(device);
             const std::chrono::milliseconds timeout(static_cast<std::int64_t>(timeout_s * 1000));
             py::gil_scoped_release nogil;
             return NcclHandle{unwrap(transport::make_nccl_group(rank, size, std::vector<std::uint8_t>(id.begin(), id.end()),
                                                                 dev, transport::NcclJoin{timeout, {}})),
                               timeout};
           }),
           py::arg("rank"), py::arg("size"), py::arg("unique_id"), py::arg("device"), py::arg("timeout_s") = 300.0)
      .def_property_readonly("rank", [](const NcclHandle& h) { return h.group->rank(); })
      .def_property_readonly("size", [](const NcclHandle& h) { return h.group->size(); })
      .def_property_readonly("device", [](const NcclHandle& h) { return h.group->device().str(); })
      .def("allreduce", [](const NcclHandle& h, at::Tensor t) {
        h.run("allreduce", [&](transport::Done d) { h.group->allreduce(t, d); });
      }, py::arg("tensor"), "tensor becomes the sum over the members, in place.")
      .def("reduce", [](const NcclHandle& h, at::Tensor t, int root) {
        h.run("reduce", [&](transport::Done d) { h.group->reduce(t, root, d); });
      }, py::arg("tensor"), py::arg("root"), "root's tensor becomes the sum, in place.")
      .def("broadcast", [](const NcclHandle& h, at::Tensor t, int root) {
        h.run("broadcast", [&](transport::Done d) { h.group->broadcast(t, root, d); });
      }, py::arg("tensor"), py::arg("root"), "tensor becomes root's, in place.")
      .def("allgather", [](const NcclHandle& h, at::Tensor in, at::Tensor out) {
        h.run("allgather", [&](transport::Done d) { h.group->allgather(in, out, d); });
      }, py::arg("input"), py::arg("output"), "output (size times input, dim 0) becomes every member's input, in member order.")
      .def("reduce_scatter", [](const NcclHandle& h, at::Tensor in, at::Tensor out) {
        h.run("reduce_scatter", [&](transport::Done d) { h.group->reduce_scatter(in, out, d); });
      }, py::arg("input"), py::arg("output"), "output becomes this member's slice of the sum of every input.")
      .def("exchange", [](const NcclHandle& h, std::vector<at::Tensor> send, int to, std::vector<at::Tensor> recv, int from) {
        h.run("exchange", [&](transport::Done d) { h.group->exchange(send, to, recv, from, d); });
      }, py::arg("send"), py::arg("to"), py::arg("recv"), py::arg("from_"),
         "Point to point, matched by order: sends each of `send` to member `to` and fills each of `recv` "
         "(allocated by the caller) from member `from_`, as one NCCL group (a member may exchange with itself).")
      .def("abort", [](const NcclHandle& h, const std::string& why) {
        h.group->abort(Status(ErrorCode::kExecution, why));
      }, py::arg("why"), "Fails everything pending and later with `why` (ends kernels waiting for a lost member).");

  py::class_<runtime::ProcessGroup, std::shared_ptr<runtime::ProcessGroup>>(
      m, "ProcessGroup", "The processes of one job: rendezvous (CAF remote actors), UCX between every two.")
      .def(py::init([](int rank, int world, const std::string& host, int port, const std::string& job, double timeout_s,
                       const std::string& version) {
             runtime::ProcessGroupOptions o;
             o.rank = rank;
             o.world = world;
             o.host = host;
             o.port = port;
             o.job = job;
             o.version = version;
             o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
             py::gil_scoped_release nogil;
             return unwrap(runtime::ProcessGroup::create(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("host") = "127.0.0.1", py::arg("port") = 29500,
           py::arg("job") = "", py::arg("timeout_s") = 120.0, py::arg("version") = "",
           "Joins the job: process 0 listens at host:port, the others connect; every process connects to every "
           "other over UCX. job: a fingerprint every process must share. timeout_s: the rendezvous and every "
           "later wait. version: the conveyor version to announce (empty: this build's; tests of mismatches).")
      .def("close", [](runtime::ProcessGroup& g) {
        py::gil_scoped_release nogil;
        g.close();
      }, "Leaves the job in step with the others (a last exchange, then connections flushed as they close).")
      .def("abort", [](runtime::ProcessGroup& g, const std::string& why) {
        g.abort(Status(ErrorCode::kExecution, why));
      }, py::arg("why"), "Gives up: everything pending and later fails with `why`; close() then only closes.")
      .def_property_readonly("rank", &runtime::ProcessGroup::rank)
      .def_property_readonly("world_size", &runtime::ProcessGroup::world_size)
      .def("broadcast_bytes", [](const runtime::ProcessGroup& g, int root, const py::bytes& data) {
        std::string in = data;
        std::string out;
        {
          py::gil_scoped_release nogil;
          out = unwrap(g.broadcast_bytes(root, in));
        }
        return py::bytes(out);
      }, py::arg("root"), py::arg("data"), "root's bytes, on every process.")
      .def("broadcast", [](const runtime::ProcessGroup& g, at::Tensor t, int root) {
        py::gil_scoped_release nogil;
        check(g.broadcast(std::move(t), root));
      }, py::arg("tensor"), py::arg("root"), "tensor becomes process root's, in place, on every process.")
      .def("allreduce", [](const runtime::ProcessGroup& g, at::Tensor t) {
        py::gil_scoped_release nogil;
        check(g.wait([&](transport::Done d) { g.all().allreduce(t, d); }, "an allreduce"));
      }, py::arg("tensor"), "tensor becomes the sum over the processes (in process order), in place.")
      .def("nccl", [](runtime::ProcessGroup& g, const std::string& device) {
        auto dev = c10::Device(device);
        py::gil_scoped_release nogil;
        return NcclHandle{unwrap(g.nccl(dev)), g.timeout()};
      }, py::arg("device"), "The NCCL group over every process on this process's CUDA device (member i is process i); "
         "made on first use. Every process calls it, in the same order.")
      .def("nccl_subgroup", [](runtime::ProcessGroup& g, std::vector<int> members, const std::string& device) -> py::object {
        auto dev = c10::Device(device);
        std::shared_ptr<transport::NcclGroup> group;
        {
          py::gil_scoped_release nogil;
          group = unwrap(g.nccl_subgroup(members, dev));
        }
        if (!group) return py::none();
        return py::cast(NcclHandle{group, g.timeout()});
      }, py::arg("members"), py::arg("device"),
         "An NCCL group over some processes (ascending ranks; member i is members[i]) on this process's CUDA "
         "device; None where this process is not a member. Every process calls it for every such group, in one order.");

  py::class_<runtime::PipelineStep>(m, "PipelineStep",
                                    "One pipelined training step over stages of a graph, in this process.")
      .def(py::init([](const std::shared_ptr<GraphExecutor>& ex, std::vector<std::vector<NodeId>> stages,
                       const std::string& schedule, int microbatches, int chunks, std::vector<int> replicas,
                       std::int64_t bucket_bytes, int intra_op_threads, const std::string& plan_json,
                       std::shared_ptr<runtime::ProcessGroup> processes, std::vector<int> rank_process,
                       double step_timeout_s, std::vector<std::vector<int>> replica_process,
                       std::optional<std::uint64_t> seed, const std::string& transport) {
             scheduler::ScheduleSpec spec;
             spec.kind = unwrap(scheduler::schedule_kind_from_name(schedule));
             spec.chunks = chunks;
             spec.ranks = static_cast<int>(stages.size()) / std::max(chunks, 1);
             spec.microbatches = microbatches;
             runtime::PipelineOptions options;
             if (!plan_json.empty()) {
               // The plan this pipeline runs: its simulated step is the live profile's reference.
               auto plan = unwrap(partitioner::Plan::from_json(plan_json));
               const auto planned = plan.schedule_spec();
               if (planned.kind != spec.kind || planned.ranks != spec.ranks || planned.chunks != spec.chunks ||
                   planned.microbatches != spec.microbatches) {
                 check(Status(ErrorCode::kInvalidArgument,
                              "the plan describes a different pipeline (" + std::to_string(planned.stages()) +
                                  " stages, " + std::string(scheduler::schedule_kind_name(planned.kind)) + ", " +
                                  std::to_string(planned.microbatches) + " microbatches) than the one built; "
                                  "pass the plan the stages came from"));
               }
               options.predicted = unwrap(plan.simulate());
             }
             options.replicas = std::move(replicas);
             if (bucket_bytes > 0) options.bucket_bytes = bucket_bytes;
             options.intra_op_threads = intra_op_threads;
             options.processes = std::move(processes);
             options.rank_process = std::move(rank_process);
             options.replica_process = std::move(replica_process);
             if (step_timeout_s > 0) {
               options.step_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(step_timeout_s * 1000));
             }
             options.seed = seed;
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
           py::arg("intra_op_threads") = 0, py::arg("plan") = std::string(), py::arg("processes") = nullptr,
           py::arg("rank_process") = std::vector<int>{}, py::arg("step_timeout_s") = 0.0,
           py::arg("replica_process") = std::vector<std::vector<int>>{}, py::arg("seed") = py::none(),
           py::arg("transport") = "ucx",
           "replicas: per rank (empty: one each); bucket_bytes: gradient reduction bucket size (0: 4 MiB); "
           "intra_op_threads: torch threads per replica (0: the caller's shared out); plan: the plan document "
           "the stages come from (its prediction is what the live profile compares against); processes, "
           "rank_process: run across the job's processes, pipeline rank r on process rank_process[r]; "
           "replica_process: the same per replica, replica i of rank r on process replica_process[r][i] (a stage "
           "whose replicas run in several processes sums its gradients across them); "
           "step_timeout_s: a step that takes longer fails (0: 10 minutes); seed: random operators (dropout) "
           "of each forward draw from a generator seeded from it, the step, the stage, the microbatch and the "
           "replica (None: drawn from torch's global generator now; across processes, process 0's); transport: how "
           "activations and gradients cross between processes, \"ucx\" (host memory) or \"nccl\" (GPU memory, "
           "one GPU per process).")
      .def("gather_state", [](runtime::PipelineStep& step) {
        py::gil_scoped_release nogil;
        check(step.gather_state());
      }, "Many processes: every parameter and buffer becomes its owner's, whole, on every process (collective; "
         "the next step releases what this process's stages do not read).")
      .def("owners", [](const runtime::PipelineStep& step) {
        py::dict out;
        for (const auto& [name, process] : step.owners()) out[py::str(name)] = process;
        return out;
      }, "Many processes: {parameter or buffer name: the process that owns it} (empty in one process).")
      .def(
          "run",
          [](runtime::PipelineStep& step, const py::sequence& inputs, double grad_scale) {
            std::vector<c10::IValue> values;
            for (auto h : inputs) values.push_back(to_ivalue(h));
            runtime::StepResult r;
            {
              py::gil_scoped_release nogil;
              r = unwrap(step.run(values, grad_scale));
            }
            return py::make_tuple(r.loss, r.measured.step_time_s, r.measured.spans.size());
          },
          py::arg("inputs"), py::arg("grad_scale") = 1.0,
          "Runs every microbatch forward and backward; returns (loss, measured seconds, actions timed).")
      .def("write_trace", [](const runtime::PipelineStep& step, const std::string& path) {
        check(step.write_trace(path));
      }, "Writes the last step's measured actions as a Perfetto trace.")
      .def("spans", [](const runtime::PipelineStep& step) {
        py::list out;
        for (const auto& s : step.last_step().spans) {
          static const char* streams[] = {"compute", "send", "collective", "across processes"};
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
          d["forward_s"] = s.forward_s;
          d["backward_s"] = s.backward_s;
          d["backward_weight_s"] = s.backward_weight_s;
          d["send_s"] = s.send_s;
          d["allreduce_s"] = s.allreduce_s;
          d["predicted_forward_s"] = s.predicted_forward_s;
          d["predicted_backward_s"] = s.predicted_backward_s;
          d["predicted_backward_weight_s"] = s.predicted_backward_weight_s;
          d["predicted_send_s"] = s.predicted_send_s;
          d["predicted_allreduce_s"] = s.predicted_allreduce_s;
          d["compute_ratio"] = s.compute_ratio();
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

  // Planning (torch-free C++ behind it): documents in, documents out.
  m.def("graph_hash", [](const PyGraph& g) { return partitioner::graph_hash(g.graph); },
        "The hash profiles are keyed by.");
  m.def(
      "plan",
      [](const PyGraph& g, const std::string& profile_json, const std::string& cluster_toml, int batch,
         int microbatches, const std::vector<std::string>& schedules, double optimizer_state, int max_replicas,
         int max_microbatches) {
        auto profile = unwrap(partitioner::Profile::from_json(profile_json));
        auto costs = unwrap(partitioner::cost_graph_from_profile(g.graph, profile));
        auto cluster = unwrap(partitioner::Cluster::from_toml(cluster_toml, "cluster"));
        partitioner::PlanOptions o;
        o.batch = batch;
        o.microbatches = microbatches;
        o.optimizer_bytes_per_param_byte = optimizer_state;
        o.max_replicas = max_replicas;
        if (max_microbatches > 0) o.max_microbatches = max_microbatches;
        for (const auto& name : schedules) o.schedules.push_back(unwrap(scheduler::schedule_kind_from_name(name)));
        partitioner::Plan plan;
        {
          py::gil_scoped_release nogil;
          plan = unwrap(partitioner::make_plan(costs, cluster, o));
        }
        return py::make_tuple(plan.to_json(), plan.table());
      },
      py::arg("graph"), py::arg("profile"), py::arg("cluster"), py::arg("batch"), py::arg("microbatches") = 0,
      py::arg("schedules") = std::vector<std::string>{}, py::arg("optimizer_state") = 2.0, py::arg("max_replicas") = 0,
      py::arg("max_microbatches") = 0,
      "Plans a captured graph from its profile on a cluster (TOML text); returns (plan JSON, table).");
}
