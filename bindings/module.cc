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
      // A message may quote bytes of a bad file that are not UTF-8: replaced, never a
      // UnicodeDecodeError in place of the error.
      const std::string& text = e.status.message();
      py::object message = py::reinterpret_steal<py::object>(
          PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace"));
      PyErr_SetObject(cls.ptr(), message.ptr());
    }
  });

  bind_graph(m);
  bind_processes(m);
  bind_pipeline(m);
}
