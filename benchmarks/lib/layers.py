"""Building the layer under test on a synthetic checkpoint, with the package's layer API.

``make_layer`` writes (once per folder) a one-layer synthetic checkpoint of a geometry and loads it
with ``KdaLayer.from_pretrained``; ``with_options`` switches a layer's KdaOptions fields (the only
settings a benchmark variant may change).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


def write_checkpoint(directory: Path, geometry, name: str | None = None) -> Path:
    """A one-layer synthetic checkpoint of `geometry` (a name or a KdaConfig) in directory/name,
    written on first use (seed 0)."""
    from glm_kda.synthetic import write_synthetic_checkpoint

    path = Path(directory) / (name or str(geometry))
    if not (path / "config.json").exists():
        write_synthetic_checkpoint(path, geometry, num_layers=1)
    return path


def make_layer(directory: Path, geometry, max_tokens: int, name: str | None = None, own_workspace: bool = False,
               options=None, workspace_rows: int | None = None):
    """KdaLayer of layer 0 of the synthetic checkpoint of `geometry` in `directory` (written if
    needed). own_workspace: a KdaWorkspace of its own instead of the shared one, so that its memory
    goes with the layer, of `workspace_rows` rows (default max_tokens; fewer: prefills in segments),
    of the kind options.stage_buffers asks for."""
    from glm_kda.config import KdaConfig
    from glm_kda.gpu.layer import KdaLayer

    path = write_checkpoint(directory, geometry, name)
    workspace = None
    if own_workspace:
        from glm_kda.gpu.workspace import KdaWorkspace

        workspace = KdaWorkspace(KdaConfig.from_pretrained(path, chunk=64), workspace_rows or max_tokens,
                                 stage_buffers=options is not None and options.stage_buffers)
    return KdaLayer.from_pretrained(path, 0, max_tokens=max_tokens, chunk=64, workspace=workspace, options=options,
                                    progress=False)


def with_options(layer, **fields) -> None:
    """Set KdaOptions fields of `layer` (layer.options is a frozen dataclass: replaced whole)."""
    layer.options = dataclasses.replace(layer.options, **fields)


def last_graph(layer):
    """The captured graph of the layer's last decode-side call (launch(stream) replays it alone)."""
    return layer.graphs.last_graph


def option_fields() -> dict:
    """The KdaOptions fields and their defaults (what a --variant may name)."""
    from glm_kda.options import KdaOptions

    return {f.name: f.default for f in dataclasses.fields(KdaOptions)}


def parse_options(text: str) -> dict:
    """name=value[,name=value...] of KdaOptions fields, each value a Python literal (hopper=False,
    chunk_impl=fp32; a bare word is taken as a string). An unknown name or a malformed item is an
    argparse.ArgumentTypeError naming it and the fields there are (argparse prints it; use it as an
    argument's type)."""
    import argparse
    import ast

    known = option_fields()
    settings = {}
    for item in text.split(","):
        name, equals, value = item.partition("=")
        name = name.strip()
        if not equals or name not in known:
            raise argparse.ArgumentTypeError(f"{text!r}: expected name=value[,name=value...] with names among the KdaOptions fields "
                             f"{sorted(known)}")
        try:
            settings[name] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            settings[name] = value.strip()
    return settings
