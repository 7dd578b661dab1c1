"""lamina-backend-template: a TEMPLATE for accelerator authors, not a device.

A complete, installable lamina backend package that runs on the host CPU. Copy it,
rename it, and replace each method body with the vendor call its docstring names.
The guide is ``docs/plugin-authors.md`` in the lamina repository.
"""

from lamina_template.backend import BACKEND_NAME, TEMPLATE_NOTE, TemplateBackend, TemplateHandle

__all__ = ["BACKEND_NAME", "TEMPLATE_NOTE", "TemplateBackend", "TemplateHandle"]
