"""``lamina plugin new``: a new backend package, made from the template shipped in core.

The template lives in ``backend_template/`` (package data, so it works from an installed
wheel); ``plugins/template_backend`` in lamina's repository is that template rendered
with the name ``template``, and a test keeps the two identical.
"""

from lamina.scaffold.names import RESERVED_NAMES, BackendNames, backend_names
from lamina.scaffold.render import render_files, write_backend_package

__all__ = [
    "RESERVED_NAMES",
    "BackendNames",
    "backend_names",
    "render_files",
    "write_backend_package",
]
