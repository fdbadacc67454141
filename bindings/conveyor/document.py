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
