// The Python extension `conveyor._C`: each area binds itself (bindings/bindings.h); here
// only the module, the translator that turns a failed Status into the Python exception
// class conveyor/errors.py names for its code, and the signal check of waits without the
// GIL, whose exception that translator raises in place of their error.
#include "bindings/bindings.h"
#include "graph/format.h"

using namespace conveyor;
using namespace conveyor::bindings;

namespace {

unsigned long main_thread = 0;  // Python's main thread (threading.main_thread().ident)
// What a signal handler raised in a wait (python_signal_raised), until the wait's error is
// raised as it. Guarded by the GIL.
PyObject* raised_type = nullptr;
PyObject* raised_value = nullptr;
PyObject* raised_traceback = nullptr;

}  // namespace

bool conveyor::bindings::python_signal_raised() {
  if (PyThread_get_thread_ident() != main_thread) return false;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return false;  // a wait at exit (a group closed as Python ends)
#else
  if (_Py_IsFinalizing()) return false;
#endif
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  if (raised_type == nullptr) {
    PyErr_Fetch(&raised_type, &raised_value, &raised_traceback);
  } else {
    PyErr_Clear();  // the first one raised is the one the wait ends with
  }
  return true;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "conveyor's C++ core: graph IR, file format, executor, planner, pipeline runtime";
  m.attr("GRAPH_FORMAT_VERSION") = graph::kGraphFormatVersion;
  m.attr("CONTAINER_VERSION") = graph::kContainerVersion;
  main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::gil_scoped_acquire gil;
      if (e.status.code() == ErrorCode::kInterrupted && raised_type != nullptr) {
        PyErr_Restore(raised_type, raised_value, raised_traceback);  // steals them
        raised_type = raised_value = raised_traceback = nullptr;
        return;
      }
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
