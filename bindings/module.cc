// The Python extension `conveyor._C`: each area binds itself (bindings/bindings.h); here
// only the module, and the translator that turns a failed Status into the Python exception
// class conveyor/errors.py names for its code.
#include "bindings/bindings.h"
#include "graph/format.h"

using namespace conveyor;
using namespace conveyor::bindings;

PYBIND11_MODULE(_C, m) {
  m.doc() = "conveyor's C++ core: graph IR, file format, executor, planner, pipeline runtime";
  m.attr("GRAPH_FORMAT_VERSION") = graph::kGraphFormatVersion;
  m.attr("CONTAINER_VERSION") = graph::kContainerVersion;


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

  bind_graph(m);
  bind_processes(m);
  bind_pipeline(m);
}
