// What the binding translation units share (internal to bindings/): a Status becomes a
// Python exception here and only here (StatusError, turned into the class conveyor/errors.py
// names for its code by the translator in module.cc), and values cross between Python and
// C++ (to_ivalue, to_py). Each area binds itself: graph_bindings.cc (the IR, the file format,
// the executor, planning), process_bindings.cc (UCX, NCCL, the job's processes),
// pipeline_bindings.cc (PipelineStep). A plan crosses as a PlanHandle (conveyor._C.Plan).
#pragma once

#include <torch/extension.h>

#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"
#include "partitioner/planner.h"

namespace conveyor::bindings {

namespace py = pybind11;

/// A failed Status on its way to Python.
struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return status.message().c_str(); }
  Status status;
};

[[noreturn]] inline void raise(const Status& st) { throw StatusError(st); }
inline void check(const Status& st) {
  if (!st.is_ok()) raise(st);
}
template <typename T>
T unwrap(Result<T> r) {
  if (!r.is_ok()) raise(r.status());
  return std::move(r).value();
}

/// Python's signal handlers, run from a wait that released the GIL (module.cc). Only on the
/// main thread, where Python runs them (elsewhere: false at once, without the GIL). True
/// when one raised (Ctrl-C's KeyboardInterrupt): the exception is kept, and the wait's
/// error, which must then be kInterrupted, is raised as it instead.
bool python_signal_raised();

/// A Python value (tensor, int, float, bool, None) as an IValue; a TypeError otherwise.
inline c10::IValue to_ivalue(py::handle h) {
  if (h.is_none()) return {};
  if (THPVariable_Check(h.ptr())) return THPVariable_Unpack(h.ptr());
  if (PyBool_Check(h.ptr())) return h.cast<bool>();
  if (PyLong_Check(h.ptr())) return h.cast<std::int64_t>();
  if (PyFloat_Check(h.ptr())) return h.cast<double>();
  throw py::type_error("conveyor: expected a tensor, int, float, bool or None, got " +
                       std::string(py::str(py::type::handle_of(h))));
}

inline std::vector<c10::IValue> to_ivalues(const py::sequence& seq) {
  std::vector<c10::IValue> out;
  out.reserve(seq.size());
  for (auto item : seq) out.push_back(to_ivalue(item));
  return out;
}

inline py::object to_py(const c10::IValue& v) {
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

inline py::list to_py_list(const std::vector<c10::IValue>& values) {
  py::list l;
  for (const auto& v : values) l.append(to_py(v));
  return l;
}

/// Torch-free graph structure, for planning and inspection without tensors.
struct PyGraph {
  graph::Graph graph;
};

using Stages = std::vector<std::vector<graph::NodeId>>;

/// A plan as it crosses between Python and C++ (conveyor._C.Plan): the planner's Plan, made
/// once (by the planner, or read from a plan document) and never changed, and its simulated
/// step, simulated once, the first time a pipeline or the live profile asks for it.
class PlanHandle {
 public:
  explicit PlanHandle(partitioner::Plan plan) : plan_(std::move(plan)) {}

  const partitioner::Plan& plan() const { return plan_; }

  /// The simulator's result for the plan, for a pipeline built as `built`; an error naming
  /// both when `built` (schedule, ranks, chunks, microbatches) is not the plan's pipeline.
  const scheduler::SimulationResult& prediction_for(const scheduler::ScheduleSpec& built) const {
    const scheduler::ScheduleSpec planned = plan_.schedule_spec();
    if (planned.kind != built.kind || planned.ranks != built.ranks || planned.chunks != built.chunks ||
        planned.microbatches != built.microbatches) {
      check(plan_.simulate_as_built(built).status());  // refuses before it simulates, naming both pipelines
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!prediction_) prediction_ = unwrap(plan_.simulate());
    return *prediction_;
  }

 private:
  const partitioner::Plan plan_;
  mutable std::mutex mutex_;  // guards prediction_
  mutable std::optional<scheduler::SimulationResult> prediction_;
};

void bind_graph(py::module_& m);
void bind_processes(py::module_& m);
void bind_pipeline(py::module_& m);

}  // namespace conveyor::bindings
