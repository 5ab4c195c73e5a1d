"""Triton's CPU interpreter, with triton.language patched once per kernel launch instead of once per call.

Under TRITON_INTERPRET the interpreter swaps the builtins of triton.language (and of any language module a called
function sees) for numpy-backed ones: once when a kernel launches, and again on every call of a @triton.jit helper
inside the kernel, for every program of the grid. Each of those inner patchings walks the modules' members
(inspect.getmembers) to find builtins that the first one already replaced, so it changes nothing; it was 40-60 %
of the time of an interpreted kernel here (a GEMV: 0.55 -> 0.24 s, test_kernels_moe.py 108 -> 66 s of CPU).

This keeps the launch's own patching and its restore as they are, and skips a helper call's patching when the
modules it would patch were already patched during this launch; a module a helper sees first is patched as before.
What runs is the same kernel code on the same patched builtins. Applied to Triton 3.9 (the pinned version, whose
internals this relies on) in the test processes only; anything else runs the interpreter unchanged."""
from __future__ import annotations

import inspect


def patch_language_once_per_launch() -> bool:
    """Install the skip (see the module docstring); False where it does not apply."""
    import triton

    if not triton.__version__.startswith("3.9."):
        return False
    from triton.runtime import interpreter as interp

    if not all(hasattr(interp, name) for name in ("GridExecutor", "InterpretedFunction", "InterpreterError",
                                                     "_patch_lang", "tl")):
        return False
    patched: set[int] = set()  # ids of the language modules patched since the running launch began
    lang_modules: dict = {}  # function -> ids of the language modules _patch_lang would patch for it

    def modules_of(fn) -> frozenset:
        ids = lang_modules.get(fn)
        if ids is None:  # what _patch_lang selects: triton.language and its core, as seen from fn's globals
            ids = lang_modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                               if inspect.ismodule(v) and v in (interp.tl, interp.tl.core))
        return ids

    launch = interp.GridExecutor.__call__

    def launch_patching_once(self, *args, **kwargs):
        patched.clear()
        patched.update(modules_of(self.fn))  # the launch patches them before the kernel body runs
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()  # its restore undoes them

    def helper_call(self, *args, **kwargs):  # InterpretedFunction.__call__ (a device function call), less the repeats
        ids = modules_of(self.fn)
        if not ids <= patched:
            interp._patch_lang(self.fn)
            patched.update(ids)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = launch_patching_once
    interp.InterpretedFunction.__call__ = helper_call
    return True


def np_dtypes_from_one_table() -> bool:
    """The interpreter's numpy dtype of a Triton type (_get_np_dtype), looked up in a table built once. Triton's own
    builds its 19-entry dict, hashing each Triton type in Python, on every call: ~460k calls in test_kernels_moe.py,
    ~8 % of its time. The table's values are what the original returns for each scalar type; any other type (a new
    one, a pointer's block) still goes to the original. False where it does not apply."""
    import triton

    if not triton.__version__.startswith("3.9."):
        return False
    from triton.runtime import interpreter as interp

    original, tl = getattr(interp, "_get_np_dtype", None), interp.tl
    if original is None:
        return False
    scalars = (tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
               tl.float8e4b15)
    table = {t: original(t) for t in scalars}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        np_dtype = None if isinstance(element, tl.pointer_type) else table.get(element)
        return np_dtype if np_dtype is not None else original(tt_dtype)

    interp._get_np_dtype = get_np_dtype
    return True
