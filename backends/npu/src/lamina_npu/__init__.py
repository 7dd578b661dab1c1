"""lamina-backend-npu: Huawei Ascend NPUs for lamina through torch_npu and HCCL.

The lamina plugin is :mod:`lamina_npu.plugin`. This package ``__init__`` must stay empty
of imports: the interpreter-start guard (:mod:`lamina_npu_autoload_guard`) imports
:mod:`lamina_npu.cann` in every Python process of an environment where torch_npu is
installed.
"""

__version__ = "0.1.0"
