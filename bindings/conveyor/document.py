"""Reading a graph document (docs/formats.md) as parsed JSON."""


def node_value_inputs(node: dict) -> list[int]:
    """The value ids a node of a graph document reads, lists flattened, in argument order."""
    out = []

    def walk(arg):
        if "value" in arg:
            out.append(arg["value"])
        for item in arg.get("list", []):
            walk(item)

    for a in node["args"]:
        walk(a)
    return out


def operator_at(node: dict) -> str:
    """A node's operator and, where captured, its source line: "aten::lt (model.py:12)"."""
    return f"{node['op']}" + (f" ({node['source']})" if node.get("source") else "")
