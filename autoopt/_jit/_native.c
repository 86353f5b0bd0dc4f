/* The cached call of an OptimizedFunction in C: ``CallPath``, the base class whose ``tp_call``
 * runs a repeating call's plan, and falls back to the Python path (``OptimizedFunction._call``)
 * for everything else.
 *
 * What it does is ``_call``'s first half, check for check, in the same order:
 *
 *   - jax's trace state is clean (``_compat.trace_state_clean``: two ``.value`` reads);
 *   - under "safe", the caller's frame (what ``sys._getframe(1)`` is in ``_call``), its site in
 *     the function's site dict (keyed ``(id(code), f_lasti in bytes)``, the Python key), and,
 *     where the site donates, the proof's run-time check, executed from the spec
 *     ``callsite._slot_check`` compiles (``CallSiteProof.slot_spec``): the callee name and every
 *     donated name read from the frame's own slots or globals, each the very object the call
 *     received, and ``callsite.other_code_may_run`` where a donated name is shared;
 *   - the plan for the arguments' flat signature (``_plans.flat_key``) in the site's plans (the
 *     function's under "auto"), else for their nested signature (``callsite.nested_signature``,
 *     read by ``nested_key`` into the equal key: plain dicts, lists, tuples and NamedTuples of
 *     arrays, scalars, NumPy leaves and None), or the plain plan for flat arguments
 *     (``_flat_plain``);
 *   - the plan: a plan ``_plans`` marks ``_native = (jit, positions, runner)`` (nothing to
 *     check, or a flat or nested signature donating ``positions`` under "safe") is run here,
 *     with its checks: each donated argument's reference count is the call's only (against
 *     ``refs_base``, measured through this very entry at import: ``_function``), an array is
 *     not deleted, and every container and array inside a donated pytree is held by its
 *     container alone (``shared_walk``, ``callsite.shared_parts``), and neither
 *     ``jax_debug_nans`` nor ``jax_debug_infs`` is on; then ``jit`` runs, or ``runner`` (the
 *     plan's placer-calling ``run``). Any other plan is called as Python does, with a new tuple
 *     of the arguments: the references it counts are those of ``_call``'s ``*args`` tuple.
 *
 * Anything else (a new site, a refused check, a signature without a plan, a plan's MISS,
 * keyword arguments) calls ``_call(self, *args, **kwargs)`` the way CPython calls a Python
 * ``__call__`` (``slot_tp_call``: the arguments on a stack with ``self`` in front), after this
 * code has dropped every reference it took, so the Python path sees the reference counts it
 * always saw, and decides everything again from scratch. No check is done only here.
 *
 * Built for CPython 3.11 only (the frame's layout is internal: ``pycore_frame.h``); elsewhere
 * the module exists with ``SUPPORTED = False`` and autoopt runs the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API)
#define AUTOOPT_FAST 1
#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#include "internal/pycore_pystate.h"
#include "internal/pycore_pyerrors.h"
#undef Py_BUILD_CORE
#else
#define AUTOOPT_FAST 0
#endif

#if AUTOOPT_FAST

/* What every call reads, set once by ``configure`` (module state of one interpreter). */
static PyObject *trace_state, *eval_trace, *axis_env, *top_axis_env; /* trace_state_clean */
static PyObject *debug_nans, *debug_infs;                            /* .value of each */
static PyObject *array_type;      /* jaxlib's ArrayImpl */
static PyObject *plain_types;     /* frozenset: PLAIN_TYPES */
static PyObject *other_code_may_run, *fit_check_type, *first_call, *filter_traceback;
static PyObject *miss;            /* _plans.MISS */
/* The functions behind ``.value`` of jax's config states, ``ArrayImpl.aval`` and
 * ``ArrayImpl.is_deleted`` (each a property's getter or a method of the type, found once by
 * ``_function``), called directly: the attribute lookup each call would find the same one. */
static PyObject *value_getter[4], *aval_getter, *is_deleted_fn;
static Py_ssize_t refs_base = -1; /* a lone local argument's reference count in tp_call */
/* ``callsite.nested_signature``'s tables (``configure_nested``): the NamedTuple types jax
 * flattens by its default rule (the set ``callsite`` fills as it meets them), the NumPy leaf
 * types, the Python scalar types. NULL: nested signatures are left to the Python path. */
static PyObject *namedtuple_types, *host_leaf_types, *scalar_types;
#define NESTED_DEPTH 48 /* callsite._NESTED_DEPTH */
static PyObject *local_tag; /* a binding's tag of a function's local (``bind_targets``) */
static PyObject *s_value, *s_donates, *s_plans, *s_proof, *s_slot_spec, *s_binding, *s_same_call,
    *s_lookup_plain,
    *s_native, *s_is_deleted, *s_call, *s_fit_escaped, *s_aval, *s_shape, *s_dtype, *empty_dict;

/* Threads inside a plan's executable run from here: ``_fit.caught_here`` asks (``catching``)
 * whether this thread is, as it looks for the Python plans' catcher frames. */
#define MAX_CATCHING 64
static PyThreadState *catching_threads[MAX_CATCHING];
static int catching_depth[MAX_CATCHING];
static int catching_used; /* one past the last slot in use (the GIL guards all three) */

typedef struct {
    PyObject_HEAD
    int mode;              /* 0: the Python path; 1: this one; 2: measure (``refs_in_call``) */
    PyObject *sites;       /* "safe": the site dict; else NULL */
    PyObject *auto_plans;  /* "auto": the function's plans; else NULL */
    PyObject *caches;      /* ``Caches``: ``lookup_plain`` */
    PyObject *plain_run;   /* the plain plan when ``_flat_plain``, else NULL */
    /* The last site, valid while the site dict's version is unchanged (sites are only added,
     * and a ``Site``'s fields are fixed once it is stored). */
    PyCodeObject *last_code;
    int last_lasti;
    uint64_t last_version;
    PyObject *last_site;
    PyObject *last_spec;   /* the proof's slot spec, or None; NULL when the site donates nothing */
    PyObject *last_plans;  /* the site's plans, or None */
    PyObject *last_binding; /* the proof's binding (``CallSiteProof.binding``), or None */
    /* The last signature's plan: valid for a call whose flat key holds the same objects while
     * the plans dict it was found in is unchanged (same dict, same version). */
    PyObject *key_plans;
    uint64_t key_version;
    PyObject *key;
    PyObject *key_plan;
    /* The same for the last nested signature: its key holds the same objects at every level
     * (``same_objects``: avals are interned), so the key, a new tuple of tuples each call, is
     * not hashed and compared in the plans dict again. (Its benefit was not measured apart
     * from the script rows' change it came with.) */
    PyObject *nkey_plans;
    uint64_t nkey_version;
    PyObject *nkey;
    PyObject *nkey_plan;
} CallPath;

static int
cp_clear(CallPath *self)
{
    Py_CLEAR(self->sites);
    Py_CLEAR(self->auto_plans);
    Py_CLEAR(self->caches);
    Py_CLEAR(self->plain_run);
    Py_CLEAR(self->last_code);
    Py_CLEAR(self->last_site);
    Py_CLEAR(self->last_spec);
    Py_CLEAR(self->last_plans);
    Py_CLEAR(self->last_binding);
    Py_CLEAR(self->key_plans);
    Py_CLEAR(self->key);
    Py_CLEAR(self->key_plan);
    Py_CLEAR(self->nkey_plans);
    Py_CLEAR(self->nkey);
    Py_CLEAR(self->nkey_plan);
    self->mode = 0;
    return 0;
}

static int
cp_traverse(CallPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sites);
    Py_VISIT(self->auto_plans);
    Py_VISIT(self->caches);
    Py_VISIT(self->plain_run);
    Py_VISIT(self->last_code);
    Py_VISIT(self->last_site);
    Py_VISIT(self->last_spec);
    Py_VISIT(self->last_plans);
    Py_VISIT(self->last_binding);
    Py_VISIT(self->key_plans);
    Py_VISIT(self->key);
    Py_VISIT(self->key_plan);
    Py_VISIT(self->nkey_plans);
    Py_VISIT(self->nkey);
    Py_VISIT(self->nkey_plan);
    return 0;
}

static void
cp_dealloc(CallPath *self)
{
    PyObject_GC_UnTrack(self);
    cp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* --- the checks --------------------------------------------------------------------------- */

/* ``obj.<name>`` through ``getter`` (``obj`` is of the type the getter was found on), or the
 * attribute itself without one. */
static inline PyObject *
get_via(PyObject *obj, PyObject *getter, PyObject *name)
{
    if (getter != NULL)
        return PyObject_Vectorcall(getter, &obj, 1, NULL);
    return PyObject_GetAttr(obj, name);
}

/* 1: clean, 0: inside a transformation, -1: error. */
static int
trace_clean(void)
{
    PyObject *v = get_via(trace_state, value_getter[0], s_value);
    if (v == NULL)
        return -1;
    int ok = v == eval_trace;
    Py_DECREF(v);
    if (!ok)
        return 0;
    v = get_via(axis_env, value_getter[1], s_value);
    if (v == NULL)
        return -1;
    ok = v == top_axis_env;
    Py_DECREF(v);
    return ok;
}

/* 1: either debug flag is on, 0: off, -1: error. */
static int
debug_checks_on(void)
{
    PyObject *states[2] = {debug_nans, debug_infs};
    for (int i = 0; i < 2; i++) {
        PyObject *v = get_via(states[i], value_getter[2 + i], s_value);
        if (v == NULL)
            return -1;
        int on = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (on != 0)
            return on;
    }
    return 0;
}

/* The caller's frame: what ``sys._getframe(1)`` returns in ``_call`` (incomplete frames, whose
 * first instruction has not run, are skipped as there). */
static _PyInterpreterFrame *
caller_frame(void)
{
    _PyInterpreterFrame *f = PyThreadState_GET()->cframe->current_frame;
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

/* Whether a thread other than ``me`` has a Python frame (``len(sys._current_frames()) > 1``,
 * read as CPython reads it: every interpreter's thread states under the runtime's head lock),
 * or a trace or profile function is set on ``me`` (``sys.gettrace()``, ``sys.getprofile()``,
 * or a C tracer's): ``callsite.other_code_may_run`` but its signal handlers. */
static int
other_frames_may_run(PyThreadState *me)
{
    if (me->c_tracefunc != NULL || me->c_profilefunc != NULL)
        return 1;
    int found = 0;
    PyThread_acquire_lock(_PyRuntime.interpreters.mutex, WAIT_LOCK);
    for (PyInterpreterState *i = _PyRuntime.interpreters.head; i != NULL && !found; i = i->next)
        for (PyThreadState *t = i->threads.head; t != NULL && !found; t = t->next)
            found = t != me && t->cframe != NULL && t->cframe->current_frame != NULL;
    PyThread_release_lock(_PyRuntime.interpreters.mutex);
    return found;
}

/* ``callsite.other_code_may_run()``, whose signal handlers this code cannot read: 1, 0, or -1
 * on error. */
static int
handlers_may_run(void)
{
    PyObject *r = PyObject_CallNoArgs(other_code_may_run);
    if (r == NULL)
        return -1;
    int may = PyObject_IsTrue(r);
    Py_DECREF(r);
    return may;
}

/* ``_slot_check``'s check from its spec ``(callee global name or None, shared, ((index, is a
 * cell, key), ...), ((key, global name), ...))``, a key being None for the callee, else the
 * argument's position (a keyword never reaches here). 1: passed, 0: refused, -1: error.
 *
 * A shared name (a global, a cell) could be read by other code while its array is donated:
 * another thread, a tracer, or a signal handler (``callsite.other_code_may_run``). Threads and
 * tracers are asked here, in C. A handler runs only on the main thread, between bytecodes, and
 * a call on this path that holds signals (``hold_signals``) runs none from its plan's checks
 * (reference counts, in C) until its names are bound: no bytecode runs between them, and
 * ``main_thread`` is cleared from the executable's call to the binding. So on the main thread
 * the handlers are left to the plan (``*handlers_unread`` set): ``run_plan`` reads them where
 * that is not so (a plan in Python, a placer's run, no hold). Elsewhere they are read here. */
static int
run_spec(PyObject *spec, _PyInterpreterFrame *f, PyObject *callee, PyObject *args,
         int identities_only, int *handlers_unread)
{
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4)
        return 0;
    PyObject *root = PyTuple_GET_ITEM(spec, 0), *shared = PyTuple_GET_ITEM(spec, 1);
    PyObject *slots = PyTuple_GET_ITEM(spec, 2), *globals = PyTuple_GET_ITEM(spec, 3);
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (!(f->f_code->co_flags & CO_OPTIMIZED) && f->f_locals != f->f_globals)
        return 0; /* module-level code run with separate locals: the names bind elsewhere */
    if (!identities_only && !PyDict_CheckExact(f->f_globals))
        return 0; /* (``exec`` with a dict subclass: the names could not be bound early) */
    if (shared == Py_True && !identities_only) {
        PyThreadState *ts = PyThreadState_GET();
        if (other_frames_may_run(ts))
            return 0;
        if (handlers_unread != NULL && _Py_ThreadCanHandleSignals(ts->interp)) {
            *handlers_unread = 1;
        } else {
            int may = handlers_may_run();
            if (may != 0)
                return may < 0 ? -1 : 0;
        }
    }
    if (root != Py_None) { /* the callee is a global (or a builtin) */
        PyObject *value = PyDict_GetItemWithError(f->f_globals, root);
        if (value == NULL) {
            if (PyErr_Occurred())
                return -1;
            value = PyDict_GetItemWithError(f->f_builtins, root);
            if (value == NULL && PyErr_Occurred())
                return -1;
        }
        if (value != callee)
            return 0;
    }
    Py_ssize_t nlocals = f->f_code->co_nlocalsplus;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); i++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, i);
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(slot, 0));
        if (index < 0 || index >= nlocals)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *value = f->localsplus[index];
        if (value == NULL)
            return 0; /* unbound */
        if (PyTuple_GET_ITEM(slot, 1) == Py_True && PyCell_Check(value)) {
            value = PyCell_GET(value);
            if (value == NULL)
                return 0; /* an empty cell */
        }
        PyObject *key = PyTuple_GET_ITEM(slot, 2);
        PyObject *want;
        if (key == Py_None) {
            want = callee;
        } else {
            Py_ssize_t k = PyLong_Check(key) ? PyLong_AsSsize_t(key) : -1;
            if (k < 0 || k >= nargs)
                return PyErr_Occurred() ? -1 : 0;
            want = PyTuple_GET_ITEM(args, k);
        }
        if (value != want)
            return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(globals); i++) {
        PyObject *pair = PyTuple_GET_ITEM(globals, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        Py_ssize_t k = PyLong_Check(key) ? PyLong_AsSsize_t(key) : -1;
        if (k < 0 || k >= nargs)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *value = PyDict_GetItemWithError(f->f_globals, PyTuple_GET_ITEM(pair, 1));
        if (value == NULL && PyErr_Occurred())
            return -1;
        if (value != PyTuple_GET_ITEM(args, k))
            return 0;
    }
    return 1;
}

/* ``_plans.flat_key``: a jax array's ``aval``, anything else's type, per argument. */
static PyObject *
flat_key(PyObject *args)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n);
    if (key == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyObject *item;
        if ((PyObject *)Py_TYPE(a) == array_type) {
            item = get_via(a, aval_getter, s_aval);
            if (item == NULL) {
                Py_DECREF(key);
                return NULL;
            }
        } else {
            item = Py_NewRef((PyObject *)Py_TYPE(a));
        }
        PyTuple_SET_ITEM(key, i, item);
    }
    return key;
}

static PyObject *
copy_args(PyObject *args)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *copy = PyTuple_New(n);
    if (copy == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(copy, i, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    return copy;
}

/* Whether ``obj`` has a weak reference (``callsite.weakly_held``): one reads it without a
 * reference, so an argument holding such an array or node is not donated. */
static inline int
weakly_held(PyObject *obj)
{
    Py_ssize_t offset = Py_TYPE(obj)->tp_weaklistoffset;
    if (offset <= 0) /* (3.11: no weak references at all, as plain dicts, lists and tuples) */
        return 0;
    return *(PyObject **)((char *)obj + offset) != NULL;
}

/* --- nested signatures ------------------------------------------------------------------- */

/* A marker for "not a nested signature" (``callsite._NOT_NESTED``): a borrowed pointer never
 * returned to Python. */
static PyObject not_nested_marker;
#define NOT_NESTED (&not_nested_marker)

/* 1: ``t`` is a NamedTuple type ``callsite`` met and found flattened by jax's default rule,
 * 0: not (or not yet met: the Python path meets it first), -1: error. */
static int
is_namedtuple_node(PyTypeObject *t)
{
    if (!PyType_IsSubtype(t, &PyTuple_Type))
        return 0;
    return PySet_Contains(namedtuple_types, (PyObject *)t);
}

/* ``callsite._nested_entry``: a new reference, NOT_NESTED (borrowed), or NULL (error). */
static PyObject *
nested_entry(PyObject *a, int depth)
{
    PyTypeObject *t = Py_TYPE(a);
    if ((PyObject *)t == array_type)
        return get_via(a, aval_getter, s_aval);
    int in = PySet_Contains(scalar_types, (PyObject *)t);
    if (in != 0)
        return in < 0 ? NULL : Py_NewRef((PyObject *)t);
    if (a == Py_None)
        return Py_NewRef(Py_None);
    if (depth >= NESTED_DEPTH)
        return NOT_NESTED;
    PyObject *keys, *entries;
    if (t == &PyDict_Type) {
        Py_ssize_t n = PyDict_GET_SIZE(a), pos = 0, i = 0;
        keys = PyTuple_New(n);
        entries = PyTuple_New(n);
        if (keys == NULL || entries == NULL)
            goto error;
        PyObject *k, *v;
        while (PyDict_Next(a, &pos, &k, &v)) {
            if (i >= n || !PyUnicode_CheckExact(k))
                goto not_nested; /* (a dict changed while read: let Python read it) */
            PyTuple_SET_ITEM(keys, i, Py_NewRef(k));
            Py_INCREF(v); /* (held while read: reading it may run a metaclass's __hash__) */
            PyObject *e = nested_entry(v, depth + 1);
            Py_DECREF(v);
            if (e == NULL)
                goto error;
            if (e == NOT_NESTED)
                goto not_nested;
            PyTuple_SET_ITEM(entries, i, e);
            i++;
        }
        if (i != n)
            goto not_nested;
    } else {
        in = PySet_Contains(host_leaf_types, (PyObject *)t);
        if (in < 0)
            return NULL;
        if (in) {
            PyObject *shape = PyObject_GetAttr(a, s_shape);
            if (shape == NULL)
                return NULL;
            PyObject *dtype = PyObject_GetAttr(a, s_dtype);
            if (dtype == NULL) {
                Py_DECREF(shape);
                return NULL;
            }
            return Py_BuildValue("(ONN)", (PyObject *)t, shape, dtype);
        }
        PyObject *seq;
        if (t == &PyList_Type || t == &PyTuple_Type) {
            seq = a;
        } else {
            in = is_namedtuple_node(t);
            if (in <= 0)
                return in < 0 ? NULL : NOT_NESTED;
            seq = a;
        }
        /* A list read item by item: an item's aval getter runs no Python code, but a list may
         * still change under another thread between two reads; its length is re-read. */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        keys = PyLong_FromSsize_t(n);
        entries = PyTuple_New(n);
        if (keys == NULL || entries == NULL)
            goto error;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i >= PySequence_Fast_GET_SIZE(seq))
                goto not_nested;
            PyObject *kid = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
            PyObject *e = nested_entry(kid, depth + 1);
            Py_DECREF(kid);
            if (e == NULL)
                goto error;
            if (e == NOT_NESTED)
                goto not_nested;
            PyTuple_SET_ITEM(entries, i, e);
        }
        if (n != PySequence_Fast_GET_SIZE(seq))
            goto not_nested;
    }
    PyObject *entry = PyTuple_Pack(3, (PyObject *)t, keys, entries);
    Py_DECREF(keys);
    Py_DECREF(entries);
    return entry;
not_nested:
    Py_XDECREF(keys);
    Py_XDECREF(entries);
    return NOT_NESTED;
error:
    Py_XDECREF(keys);
    Py_XDECREF(entries);
    return NULL;
}

/* ``callsite.nested_signature(args)[0]``: a new reference, NOT_NESTED, or NULL (error). */
static PyObject *
nested_key(PyObject *args)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n);
    if (key == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = nested_entry(PyTuple_GET_ITEM(args, i), 0);
        if (e == NULL || e == NOT_NESTED) {
            /* (the key's unset items are NULL, which a tuple's dealloc skips) */
            Py_DECREF(key);
            return e;
        }
        PyTuple_SET_ITEM(key, i, e);
    }
    return key;
}

/* ``callsite.shared_parts(obj)`` for the nodes a nested signature holds (``obj`` not an
 * array): 1 when a part is also referenced from elsewhere, 0 when none is, 2 when ``obj`` or a
 * part is a node only the Python walk reads (the Python plan decides), -1 on error. A part held
 * by its container alone has a reference count of 1 here (nothing in this walk takes one). */
static int
shared_walk(PyObject *obj, int depth)
{
    if (depth >= NESTED_DEPTH)
        return 2;
    PyTypeObject *t = Py_TYPE(obj);
    if (t == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            int r = 0;
            if (v == Py_None || (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 0))
                continue; /* an empty node: no buffer, and a single object every holder shares */
            if (Py_REFCNT(v) > 1 || weakly_held(v))
                return 1;
            if ((PyObject *)Py_TYPE(v) != array_type) {
                Py_INCREF(v); /* (a dict's value may be replaced while the walk reads it) */
                r = shared_walk(v, depth + 1);
                Py_DECREF(v);
            }
            if (r != 0)
                return r;
        }
        return 0;
    }
    int node = t == &PyList_Type || t == &PyTuple_Type;
    if (!node) {
        int in = PySet_Contains(host_leaf_types, (PyObject *)t);
        if (in != 0)
            return in < 0 ? -1 : 0; /* a NumPy leaf: no buffer */
        in = PySet_Contains(scalar_types, (PyObject *)t);
        if (in != 0)
            return in < 0 ? -1 : 0; /* a Python scalar: no buffer */
        in = is_namedtuple_node(t);
        if (in <= 0)
            return in < 0 ? -1 : 2;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); i++) {
        PyObject *kid = PySequence_Fast_GET_ITEM(obj, i);
        if (kid == Py_None || (PyTuple_CheckExact(kid) && PyTuple_GET_SIZE(kid) == 0))
            continue; /* an empty node: no buffer, and a single object every holder shares */
        if (Py_REFCNT(kid) > 1 || weakly_held(kid))
            return 1;
        if ((PyObject *)Py_TYPE(kid) != array_type) {
            Py_INCREF(kid);
            int r = shared_walk(kid, depth + 1);
            Py_DECREF(kid);
            if (r != 0)
                return r;
        }
    }
    return 0;
}

/* --- running a plan ----------------------------------------------------------------------- */

static int
catching_enter(PyThreadState *ts)
{
    int free_slot = -1;
    for (int i = 0; i < catching_used; i++) { /* (slots past ``catching_used`` are all free) */
        if (catching_threads[i] == ts) {
            catching_depth[i]++;
            return i;
        }
        if (catching_threads[i] == NULL && free_slot < 0)
            free_slot = i;
    }
    if (free_slot < 0 && catching_used < MAX_CATCHING)
        free_slot = catching_used++;
    if (free_slot >= 0) {
        catching_threads[free_slot] = ts;
        catching_depth[free_slot] = 1;
    }
    return free_slot;
}

static void
catching_exit(int slot)
{
    if (slot >= 0 && --catching_depth[slot] == 0) {
        catching_threads[slot] = NULL;
        while (catching_used > 0 && catching_threads[catching_used - 1] == NULL)
            catching_used--;
    }
}

/* Exceptions out of the call path lose autoopt's and jax's frames, as ``_call``'s do. */
static void
filter_error(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallOneArg(filter_traceback, value);
    if (r == NULL) { /* the filter's own error replaces the call's, as in Python */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return;
    }
    Py_DECREF(r);
    Py_XDECREF(tb);
    tb = PyException_GetTraceback(value);
    PyErr_Restore(type, value, tb);
}

/* The executable on the arguments, catching ``FitCheck`` as ``_plans._runner`` does. A
 * ``FitCheck`` out of ``first_call`` escaped every catcher: ``_call``'s handler runs
 * (``OptimizedFunction._fit_escaped``). */
static PyObject *hs_target(PyObject *jit);
static PyTypeObject HoldsSignalsType;
static int held_depth;
/* The depth of the hold of a call whose plan left the signal handlers unread (``run_spec``),
 * while its executable's jit object is called; 0: none. Such a call checked the reference
 * counts with no handler able to run until its names are bound. A trace its jit object starts
 * (a cache miss: a new jax config context) would run handlers and the user's code in between,
 * so it is stopped at once (``suspend_deep`` raises ``SealedRetrace``) and the call goes to the
 * Python path, which reads the handlers, as if no plan were cached. (Keeping handlers held
 * through the trace instead was tried: a nested function's hold let them run, ``signal.signal``
 * in the traced function raised, and a trace could not be interrupted.) */
static int sealed_at;
static PyObject *sealed_retrace; /* the exception type (a BaseException: nothing catches it) */
static int deep_end(void);
static int deep_on, deep_at;

static PyObject *
run_jit(CallPath *self, PyObject *site, PyObject *jit, PyObject *args)
{
    int slot = catching_enter(PyThreadState_GET());
    if (slot < 0) { /* more threads at once than slots: the Python plan catches */
        return NULL;
    }
    PyObject *out = PyObject_Vectorcall(hs_target(jit), &PyTuple_GET_ITEM(args, 0),
                                        PyTuple_GET_SIZE(args), NULL);
    catching_exit(slot);
    if (out != NULL || !PyErr_ExceptionMatches(fit_check_type))
        return out;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *copy = copy_args(args);
    if (copy == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    out = PyObject_CallFunctionObjArgs(first_call, value, jit, Py_None, copy, empty_dict, NULL);
    Py_DECREF(value);
    if (out == NULL && PyErr_ExceptionMatches(fit_check_type)) {
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        out = PyObject_CallMethodObjArgs(
            (PyObject *)self, s_fit_escaped, value, site ? site : Py_None, copy, NULL);
        Py_DECREF(value);
    }
    Py_DECREF(copy);
    return out;
}

/* ``_plans.in_bounds``: 1 when every ``(position, lo, hi)`` of ``checks`` names a Python int
 * argument (exactly ``int``: never a bool, never a jax array) in ``[lo, hi]``, else 0; -1 on
 * error. Values that do not fit a C long long are out of every bound a program can have. */
static int
in_bounds(PyObject *checks, PyObject *args)
{
    if (!PyTuple_Check(checks))
        return 0;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(checks); i++) {
        PyObject *check = PyTuple_GET_ITEM(checks, i);
        if (!PyTuple_Check(check) || PyTuple_GET_SIZE(check) != 3)
            return 0;
        Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(check, 0));
        if (p < 0 || p >= nargs)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *a = PyTuple_GET_ITEM(args, p);
        if (!PyLong_CheckExact(a))
            return 0;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
        if (overflow != 0)
            return 0;
        if (v == -1 && PyErr_Occurred())
            return -1;
        long long lo = PyLong_AsLongLong(PyTuple_GET_ITEM(check, 1));
        long long hi = PyLong_AsLongLong(PyTuple_GET_ITEM(check, 2));
        if ((lo == -1 || hi == -1) && PyErr_Occurred())
            return -1;
        if (v < lo || v > hi)
            return 0;
    }
    return 1;
}

/* 1: ran (``*out`` the result, or NULL with an exception set), 0: MISS (nothing ran, no
 * reference kept), -1: an error before anything ran. A plan marked ``(jit, positions, runner,
 * checks, twin)`` (``_plans.bounded``) runs ``twin`` instead of ``jit`` for arguments
 * ``in_bounds`` of ``checks``, with the same checks. */
static int
run_plan(CallPath *self, PyObject *site, PyObject *plan, PyObject *args, PyObject **out,
         int handlers_unread, int held)
{
    PyObject *native = NULL;
    if (PyFunction_Check(plan)) {
        PyObject *d = ((PyFunctionObject *)plan)->func_dict;
        if (d != NULL) {
            native = PyDict_GetItemWithError(d, s_native);
            if (native == NULL && PyErr_Occurred())
                return -1;
        }
    }
    int is_native = native != NULL && PyTuple_Check(native) &&
                    (PyTuple_GET_SIZE(native) == 3 || PyTuple_GET_SIZE(native) == 5);
    /* (``run_spec``: signal handlers left unread are read here unless, holding signals, this
     * plan checks and calls its executable in C with no bytecode between) */
    int sealed = is_native && held && PyTuple_GET_ITEM(native, 2) == Py_None &&
                 Py_TYPE(PyTuple_GET_ITEM(native, 0)) == &HoldsSignalsType &&
                 (PyTuple_GET_SIZE(native) == 3 ||
                  Py_TYPE(PyTuple_GET_ITEM(native, 4)) == &HoldsSignalsType);
    if (handlers_unread && !sealed) {
        int may = handlers_may_run();
        if (may != 0)
            return may < 0 ? -1 : 0;
        handlers_unread = 0;
    }
    if (is_native) {
        PyObject *jit = PyTuple_GET_ITEM(native, 0), *positions = PyTuple_GET_ITEM(native, 1);
        PyObject *runner = PyTuple_GET_ITEM(native, 2);
        if (PyTuple_GET_SIZE(native) == 5) {
            if (runner != Py_None)
                goto python_plan;
            int in = in_bounds(PyTuple_GET_ITEM(native, 3), args);
            if (in < 0)
                return -1;
            if (in)
                jit = PyTuple_GET_ITEM(native, 4);
        }
        Py_ssize_t nargs = PyTuple_GET_SIZE(args);
        Py_INCREF(jit);
        Py_INCREF(positions);
        Py_INCREF(runner);
        /* 1: refused, 2: a part only the Python plan reads, -1: error */
        int refused = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(positions) && !refused; i++) {
            Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, i));
            if (p < 0 || p >= nargs) {
                refused = PyErr_Occurred() ? -1 : 1;
                break;
            }
            PyObject *a = PyTuple_GET_ITEM(args, p);
            if (Py_REFCNT(a) > refs_base || weakly_held(a)) {
                refused = 1;
                break;
            }
            if ((PyObject *)Py_TYPE(a) != array_type) {
                refused = shared_walk(a, 0);
                continue;
            }
            PyObject *deleted = is_deleted_fn != NULL
                                    ? PyObject_Vectorcall(is_deleted_fn, &a, 1, NULL)
                                    : PyObject_CallMethodNoArgs(a, s_is_deleted);
            if (deleted == NULL) {
                refused = -1;
                break;
            }
            refused = PyObject_IsTrue(deleted);
            Py_DECREF(deleted);
        }
        if (refused == 0 && PyTuple_GET_SIZE(positions) > 0)
            refused = debug_checks_on();
        Py_DECREF(positions);
        if (refused != 0) {
            Py_DECREF(jit);
            Py_DECREF(runner);
            if (refused == 2) {
                if (handlers_unread) { /* (the Python plan's checks run bytecode) */
                    int may = handlers_may_run();
                    if (may != 0)
                        return may < 0 ? -1 : 0;
                }
                goto python_plan;
            }
            return refused < 0 ? -1 : 0;
        }
        if (runner == Py_None) {
            /* (a call that left the handlers unread keeps them held through a trace its jit
             * object may start: ``suspend_deep``) */
            int outer_sealed = sealed_at;
            if (handlers_unread)
                sealed_at = held_depth;
            *out = run_jit(self, site, jit, args);
            sealed_at = outer_sealed;
            if (*out == NULL && handlers_unread && PyErr_ExceptionMatches(sealed_retrace)) {
                /* nothing ran: handlers run again (those pending now), and the Python path
                 * plans the call */
                PyErr_Clear();
                Py_DECREF(jit);
                Py_DECREF(runner);
                if (deep_on && deep_at >= held_depth && deep_end() < 0)
                    return -1;
                return 0;
            }
        } else { /* the plan's ``run(args)``: the placer, and its own catcher of FitCheck */
            PyObject *copy = copy_args(args);
            *out = copy == NULL ? NULL : PyObject_CallOneArg(runner, copy);
            Py_XDECREF(copy);
        }
        Py_DECREF(jit);
        Py_DECREF(runner);
        if (*out == NULL && !PyErr_Occurred())
            return 0; /* no catcher slot: the Python path runs it */
        return 1;
    }
python_plan:;
    /* A plan with checks of its own: called as ``_call`` calls it, on a tuple of its own. */
    PyObject *copy = copy_args(args);
    if (copy == NULL)
        return -1;
    Py_INCREF(plan);
    PyObject *r = PyObject_CallOneArg(plan, copy);
    Py_DECREF(plan);
    Py_DECREF(copy);
    if (r == miss) {
        Py_DECREF(r);
        return 0;
    }
    *out = r;
    return 1;
}

/* The plan for the arguments' flat key in ``plans`` (a new reference), or NULL (none: a new
 * signature, or arguments that are not flat). */
/* Clear the error a check raised, so that the call falls back to the Python path (which runs
 * every check again), unless it is not an ``Exception``: a KeyboardInterrupt or SystemExit that
 * a signal handler raised while a check ran Python code must reach the caller (``cp_call``
 * returns it), as it would from the Python path. */
static void
fall_back_error(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();
}

/* The plan for the arguments' nested signature (``_plans.lookup_nested``) in ``plans`` (a new
 * reference), or NULL: flat arguments (their flat key found none), a signature ``nested_key``
 * does not read (a registered node: the Python path reads its tree signature), or a new one. */
/* Whether ``a`` and ``b`` are the same object, or exact tuples of the same length whose items
 * are, at every level: then they are equal keys (every object equals itself) without calling
 * any ``__eq__``. */
static int
same_objects(PyObject *a, PyObject *b, int depth)
{
    if (a == b)
        return 1;
    if (depth > NESTED_DEPTH + 2 || !PyTuple_CheckExact(a) || !PyTuple_CheckExact(b) ||
        PyTuple_GET_SIZE(a) != PyTuple_GET_SIZE(b))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); i++)
        if (!same_objects(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i), depth + 1))
            return 0;
    return 1;
}

static PyObject *
find_nested_plan(CallPath *self, PyObject *plans, PyObject *args)
{
    if (namedtuple_types == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    Py_ssize_t i = 0;
    for (; i < n; i++) { /* ``callsite.is_flat`` */
        PyObject *t = (PyObject *)Py_TYPE(PyTuple_GET_ITEM(args, i));
        if (t != array_type) {
            int in = PySet_Contains(scalar_types, t);
            if (in < 0)
                return fall_back_error(), NULL;
            if (!in)
                break;
        }
    }
    if (i == n)
        return NULL;
    PyObject *key = nested_key(args);
    if (key == NULL)
        return fall_back_error(), NULL;
    if (key == NOT_NESTED)
        return NULL;
    if (self->nkey_plan != NULL && self->nkey_plans == plans &&
        self->nkey_version == ((PyDictObject *)plans)->ma_version_tag &&
        same_objects(key, self->nkey, 0)) {
        Py_DECREF(key);
        return Py_NewRef(self->nkey_plan);
    }
    PyObject *plan = PyDict_GetItemWithError(plans, key);
    if (plan == NULL) {
        Py_DECREF(key);
        return fall_back_error(), NULL;
    }
    Py_INCREF(plan);
    /* (the version read after the lookup, as ``find_plan`` reads it) */
    self->nkey_version = ((PyDictObject *)plans)->ma_version_tag;
    Py_XSETREF(self->nkey_plans, Py_NewRef(plans));
    Py_XSETREF(self->nkey, key);
    Py_XSETREF(self->nkey_plan, Py_NewRef(plan));
    return plan;
}

static PyObject *
find_plan(CallPath *self, PyObject *plans, PyObject *args)
{
    PyObject *key = flat_key(args);
    if (key == NULL)
        return fall_back_error(), NULL;
    uint64_t version = ((PyDictObject *)plans)->ma_version_tag;
    if (self->key_plan != NULL && self->key_plans == plans && self->key_version == version &&
        PyTuple_GET_SIZE(self->key) == PyTuple_GET_SIZE(key)) {
        Py_ssize_t i = 0;
        while (i < PyTuple_GET_SIZE(key) &&
               PyTuple_GET_ITEM(key, i) == PyTuple_GET_ITEM(self->key, i))
            i++;
        if (i == PyTuple_GET_SIZE(key)) {
            Py_DECREF(key);
            return Py_NewRef(self->key_plan);
        }
    }
    PyObject *plan = PyDict_GetItemWithError(plans, key);
    if (plan == NULL) {
        Py_DECREF(key);
        if (PyErr_Occurred())
            return fall_back_error(), NULL;
        return find_nested_plan(self, plans, args);
    }
    Py_INCREF(plan);
    /* (read after the lookup: a comparison that ran Python code and changed the dict made the
     * lookup start again, so the plan found is the one of this version) */
    self->key_version = ((PyDictObject *)plans)->ma_version_tag;
    Py_XSETREF(self->key_plans, Py_NewRef(plans));
    Py_XSETREF(self->key, key);
    Py_XSETREF(self->key_plan, Py_NewRef(plan));
    return plan;
}

/* The site of the call from frame ``f`` (its fields in ``*spec``, ``*plans``: new references,
 * ``*spec`` NULL when the site donates nothing), or 0: not found (a new site) or unreadable. */
static int
find_site(CallPath *self, _PyInterpreterFrame *f, PyObject **site, PyObject **spec,
          PyObject **plans)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    lasti = lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
    uint64_t version = ((PyDictObject *)self->sites)->ma_version_tag;
    if (!(self->last_site != NULL && self->last_code == f->f_code &&
          self->last_lasti == lasti && self->last_version == version)) {
        PyObject *key = Py_BuildValue("(Ni)", PyLong_FromVoidPtr(f->f_code), lasti);
        if (key == NULL)
            return fall_back_error(), 0;
        PyObject *found = PyDict_GetItemWithError(self->sites, key);
        Py_DECREF(key);
        if (found == NULL)
            return fall_back_error(), 0; /* a new site: the Python path proves it */
        Py_INCREF(found);
        version = ((PyDictObject *)self->sites)->ma_version_tag;
        PyObject *donates_o = PyObject_GetAttr(found, s_donates);
        int donates = donates_o ? PyObject_IsTrue(donates_o) : -1;
        Py_XDECREF(donates_o);
        PyObject *found_spec = NULL, *found_plans = NULL, *found_binding = NULL;
        if (donates > 0) {
            PyObject *proof = PyObject_GetAttr(found, s_proof);
            if (proof != NULL) {
                found_spec = PyObject_GetAttr(proof, s_slot_spec);
                found_binding = found_spec ? PyObject_GetAttr(proof, s_binding) : NULL;
                Py_DECREF(proof);
            }
            if (found_binding == NULL)
                donates = -1;
        }
        if (donates >= 0) {
            found_plans = PyObject_GetAttr(found, s_plans);
            if (found_plans == NULL)
                donates = -1;
        }
        if (donates < 0) {
            Py_DECREF(found);
            Py_XDECREF(found_spec);
            Py_XDECREF(found_binding);
            return fall_back_error(), 0;
        }
        Py_XSETREF(self->last_site, found);
        Py_XSETREF(self->last_spec, found_spec);
        Py_XSETREF(self->last_plans, found_plans);
        Py_XSETREF(self->last_binding, found_binding);
        Py_XSETREF(self->last_code, (PyCodeObject *)Py_NewRef(f->f_code));
        self->last_lasti = lasti;
        self->last_version = version;
    }
    /* Strong references: what runs next may run Python code, another thread, or this function
     * again at another site, each of which may replace the fields. */
    *site = Py_NewRef(self->last_site);
    *spec = Py_XNewRef(self->last_spec);
    *plans = Py_NewRef(self->last_plans);
    return 1;
}

/* 1: handled (``*out`` the result, or NULL with an exception set), 0: the Python path. Every
 * reference taken here is dropped before it returns 0. */
static int hold_signals(void);
static void unhold_signals(int held);

/* ``f``: the caller's frame under "safe" (``caller_frame``, read once by ``cp_call``). */
static int
fast_call(CallPath *self, _PyInterpreterFrame *f, PyObject *args, PyObject **out,
          PyObject **binding, int *held)
{
    int clean = trace_clean();
    if (clean <= 0)
        return clean < 0 ? (fall_back_error(), 0) : 0;
    PyObject *site = NULL, *spec = NULL, *plans = NULL, *bind = NULL; /* strong references */
    int r = 0, handlers_unread = 0;
    if (self->sites != NULL) {
        if (f == NULL || !find_site(self, f, &site, &spec, &plans))
            return 0;
        if (spec != NULL) { /* the site donates: its proof's check, on every call */
            if (spec == Py_None)
                goto done; /* a check without a spec: the Python path runs it */
            bind = Py_XNewRef(self->last_binding);
            int ok = run_spec(spec, f, (PyObject *)self, args, 0, &handlers_unread);
            if (ok <= 0) {
                if (ok < 0)
                    fall_back_error();
                goto done;
            }
        } else {
            PyObject *lookup = PyObject_GetAttr(self->caches, s_lookup_plain);
            int on = lookup ? PyObject_IsTrue(lookup) : -1;
            Py_XDECREF(lookup);
            if (on < 0) {
                fall_back_error();
                goto done;
            }
            if (!on)
                Py_CLEAR(plans);
        }
    } else {
        plans = Py_XNewRef(self->auto_plans);
    }
    if (plans != NULL && plans != Py_None) {
        if (!PyDict_Check(plans) || PyDict_GET_SIZE(plans) == 0)
            goto done;
        PyObject *plan = find_plan(self, plans, args);
        if (plan == NULL)
            goto done; /* not flat, or a new signature */
        /* (a call that may donate holds signals: see "the statement's names" below) */
        *held = bind != NULL ? hold_signals() : 0;
        r = run_plan(self, site, plan, args, out, handlers_unread, *held);
        Py_DECREF(plan);
        if (r != 1) {
            unhold_signals(*held); /* (nothing ran: nothing was held for it) */
            *held = 0;
        }
    } else if (self->plain_run != NULL) {
        Py_ssize_t n = PyTuple_GET_SIZE(args);
        for (Py_ssize_t i = 0; i < n; i++) {
            int in = PySet_Contains(plain_types, (PyObject *)Py_TYPE(PyTuple_GET_ITEM(args, i)));
            if (in <= 0) {
                if (in < 0)
                    fall_back_error();
                goto done;
            }
        }
        PyObject *plain = Py_NewRef(self->plain_run);
        r = run_plan(self, site, plain, args, out, handlers_unread, 0);
        Py_DECREF(plain);
    }
    if (r < 0) {
        fall_back_error();
        r = 0;
    }
    if (r == 1 && bind != NULL) { /* checked: the statement stores what this call returns */
        *binding = bind;
        bind = NULL;
    }
done:
    Py_XDECREF(site);
    Py_XDECREF(spec);
    Py_XDECREF(plans);
    Py_XDECREF(bind);
    return r;
}

/* --- the statement's names, bound before the call returns ------------------------------
 *
 * ``state = step(state)`` under "safe" donates ``state``'s arrays. Between the call's return
 * and the statement's store, CPython runs pending signal handlers (the end of every CALL
 * checks): Ctrl-C there raises ``KeyboardInterrupt`` with ``state`` still bound to the
 * deleted arrays, and an ``except KeyboardInterrupt: save(state)`` finds them gone, where
 * jax.jit, which donates nothing, lost nothing. So before a call whose proof's check passed
 * returns, the names the statement assigns are bound to what it returns, in the order the
 * statement's own stores run (``CallSiteProof.binding``): the statement then stores the same
 * objects again, and an exception at its end finds the names as if the statement had completed
 * (one of the orders jax.jit's call allows).
 *
 * Python code runs between the executable and that binding: jax's unflatten of the outputs (a
 * NamedTuple's ``__new__``, a registered node's), jax's own code around a first call's
 * execution, and autoopt's (the Python path's plans, a placer, equinox's rebuilt outputs,
 * nnx's updates of its Variables). A handler run there would raise with the result dropped.
 * So a call that may donate holds signals (``hold_signals``, main thread only: handlers run
 * there alone), and from the moment its executable is called (``HoldsSignals``, the donating
 * jit object of "safe") until the call's names are bound (``release_signals``), the thread
 * cannot run handlers: ``_PyRuntime.main_thread`` is cleared, which is what CPython asks
 * (``_Py_ThreadCanHandleSignals``) before it runs them, and what a signal's C handler asks
 * before it interrupts the evaluation. Then the pending handlers (and pending calls) run, and
 * an exception one raises propagates from the call, its names bound. The user's function and
 * the passes, which jax traces inside a first call, run with handlers as under jax.jit
 * (``suspend_deep``, called by the traced wrapper), so Ctrl-C interrupts a long trace at once. */

/* held_depth: the calls of the main thread holding signals (declared above) */
static PyThreadState *held_tstate;  /* the main thread's, while ``held_depth > 0`` */
static PyObject *held_type, *held_value, *held_tb;
static int held_at; /* the depth of the holder that was innermost when it was held */

/* deep_on: handlers cannot run (``main_thread`` cleared); deep_at: the depth of the holder
 * that cleared it (declared above) */
static unsigned long deep_main; /* the main thread's ident, restored after it */

/* Keep the exception set now for the innermost holder (a later one is dropped: the first
 * signal's exception is the one jax.jit would have raised). */
static void
hold_error(void)
{
    if (held_type != NULL) {
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&held_type, &held_value, &held_tb);
    held_at = held_depth;
}

/* 1: this call holds signals' exceptions until ``release_signals``; 0: not this thread. */
static int
hold_signals(void)
{
    PyThreadState *ts = PyThreadState_GET();
    if (held_depth > 0) {
        if (ts != held_tstate)
            return 0;
    } else {
        if (!_Py_ThreadCanHandleSignals(ts->interp))
            return 0;
        held_tstate = ts;
    }
    held_depth++;
    return 1;
}

/* Whether a call of this thread holds signals. */
static inline int
holding_here(void)
{
    return held_depth > 0 && PyThreadState_GET() == held_tstate;
}

static void
deep_begin(void)
{
    deep_main = _PyRuntime.main_thread;
    deep_at = held_depth;
    deep_on = 1;
    _PyRuntime.main_thread = 0;
}

/* Handlers can run again: the pending ones (signals, and calls other threads queued with
 * ``Py_AddPendingCall``) run now. -1: one raised (its exception set). */
static int
deep_end(void)
{
    if (!deep_on)
        return 0;
    _PyRuntime.main_thread = deep_main;
    deep_on = 0;
    if (_Py_atomic_load_relaxed(&_PyRuntime.ceval.signals_pending) ||
        _Py_atomic_load_relaxed(&held_tstate->interp->ceval.pending.calls_to_do))
        return Py_MakePendingCalls(); /* (recomputes the eval breaker as well) */
    return 0;
}

/* End a hold taken for a call that did not run (a plan's MISS). */
static void
unhold_signals(int held)
{
    if (held && held_depth > 0)
        held_depth--;
}

/* ``out`` (stolen), or NULL with the held exception set when the holder it was held for ends
 * (the innermost then: an outer call raises it as jax.jit would, from the inner call, once
 * that one's names are bound): the signal came first, so a later error of the call is
 * dropped, as under jax.jit it would never have happened. */
static PyObject *
release_signals(int held, PyObject *out)
{
    if (!held || held_depth <= 0) /* (<= 0: reset in a forked child, ``after_fork``) */
        return out;
    if (deep_on && deep_at >= held_depth) {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        if (out == NULL)
            PyErr_Fetch(&type, &value, &tb);
        if (deep_end() < 0)
            hold_error();
        if (out == NULL)
            PyErr_Restore(type, value, tb);
    }
    int mine = held_type != NULL && held_at >= held_depth;
    held_depth--;
    if (!mine)
        return out;
    Py_XDECREF(out);
    if (out == NULL)
        PyErr_Clear();
    PyErr_Restore(held_type, held_value, held_tb);
    held_type = held_value = held_tb = NULL;
    return NULL;
}

/* ``HoldsSignals(jit)``: a donating jit object of "safe" (``OptimizedFunction._jit_for``): a
 * call of it inside a call holding signals clears ``main_thread`` (above) until that call
 * releases them; anything else is the jit object's (attributes are read from it). */
typedef struct {
    PyObject_HEAD
    PyObject *inner;
    vectorcallfunc vectorcall;
    PyObject *weakrefs; /* (jax keeps weak references to the functions it is given) */
} HoldsSignals;

static PyTypeObject HoldsSignalsType;

/* What a call of ``jit`` calls (borrowed, valid while ``jit`` is): a ``HoldsSignals``'s jit
 * object, the hold begun (``run_jit`` calls it directly: one call layer fewer), else ``jit``. */
static PyObject *
hs_target(PyObject *jit)
{
    if (Py_TYPE(jit) != &HoldsSignalsType)
        return jit;
    if (!deep_on && held_type == NULL && holding_here() && _PyRuntime.main_thread != 0)
        deep_begin(); /* (main_thread 0 already: a fork's child, or another such hack) */
    return ((HoldsSignals *)jit)->inner;
}

static PyObject *
hs_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(hs_target(op), args, nargsf, kwnames);
}

/* ``suspend_deep()``: called as a trace of the wrapper starts: handlers run again on this
 * thread (those pending run now, and may raise); True when it suspended a hold, for
 * ``resume_deep``. Only the holding thread's: another thread tracing leaves it alone. */
static PyObject *
suspend_deep(PyObject *module, PyObject *unused)
{
    if (sealed_at > 0 && held_depth >= sealed_at && PyThreadState_GET() == held_tstate) {
        PyErr_SetString(sealed_retrace, "autoopt: a cached call's trace, taken again on the "
                                        "Python path (never reaches the caller)");
        return NULL; /* (see ``sealed_at``) */
    }
    if (!deep_on || PyThreadState_GET() != held_tstate)
        Py_RETURN_FALSE;
    int at = deep_at;
    if (deep_end() < 0) {
        /* (Ctrl-C during the call, before the trace: nothing ran yet; raised from here, and
         * the hold resumed for its holder to end) */
        deep_begin();
        deep_at = at;
        return NULL;
    }
    deep_at = at;
    Py_RETURN_TRUE;
}

static PyObject *
resume_deep(PyObject *module, PyObject *suspended)
{
    if (suspended == Py_True && !deep_on && holding_here() && _PyRuntime.main_thread != 0) {
        int at = deep_at;
        deep_begin();
        deep_at = at;
    }
    Py_RETURN_NONE;
}

static PyObject *
hs_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *inner;
    if (!PyArg_ParseTuple(args, "O:HoldsSignals", &inner))
        return NULL;
    HoldsSignals *self = (HoldsSignals *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->inner = Py_NewRef(inner);
    self->vectorcall = hs_vectorcall;
    return (PyObject *)self;
}

static int
hs_traverse(HoldsSignals *self, visitproc visit, void *arg)
{
    Py_VISIT(self->inner);
    return 0;
}

static int
hs_clear(HoldsSignals *self)
{
    Py_CLEAR(self->inner);
    return 0;
}

static void
hs_dealloc(HoldsSignals *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    hs_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hs_getattro(HoldsSignals *self, PyObject *name)
{
    return PyObject_GetAttr(self->inner, name);
}

static int
hs_setattro(HoldsSignals *self, PyObject *name, PyObject *value)
{
    return PyObject_SetAttr(self->inner, name, value);
}

static PyObject *
hs_repr(HoldsSignals *self)
{
    return PyObject_Repr(self->inner);
}

/* As a class attribute it binds as jax.jit's object does (a method of the instance). */
static PyObject *
hs_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyTypeObject HoldsSignalsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "autoopt._jit._native.HoldsSignals",
    .tp_basicsize = sizeof(HoldsSignals),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(HoldsSignals, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = hs_new,
    .tp_traverse = (traverseproc)hs_traverse,
    .tp_clear = (inquiry)hs_clear,
    .tp_dealloc = (destructor)hs_dealloc,
    .tp_free = PyObject_GC_Del,
    .tp_getattro = (getattrofunc)hs_getattro,
    .tp_setattro = (setattrofunc)hs_setattro,
    .tp_repr = (reprfunc)hs_repr,
    .tp_descr_get = hs_descr_get,
    .tp_weaklistoffset = offsetof(HoldsSignals, weakrefs),
    .tp_doc = "A donating jit object whose call holds a signal's exception (see _native.c).",
};

/* The binding's targets: ``(0, slot index, is a cell)`` a function's local or cell,
 * ``(1, name)`` a global (``STORE_GLOBAL``), ``(3, name)`` a module-level name (``STORE_NAME``,
 * where the frame's locals are its globals), ``(2, (target, ...))`` unpacking. 1: ``value``
 * binds as the statement's instructions will (every unpacked value an exact tuple or list of
 * the target's length, every slot and namespace as the proof found it), 0: not. */
static int
binding_fits(_PyInterpreterFrame *f, PyObject *target, PyObject *value, int depth)
{
    if (!PyTuple_CheckExact(target) || PyTuple_GET_SIZE(target) < 2 || depth > NESTED_DEPTH)
        return 0;
    long tag = PyLong_AsLong(PyTuple_GET_ITEM(target, 0));
    if (tag == 0) {
        if (PyTuple_GET_SIZE(target) != 3)
            return 0;
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        if (index < 0 || index >= f->f_code->co_nlocalsplus)
            return 0;
        if (PyTuple_GET_ITEM(target, 2) == Py_True)
            return f->localsplus[index] != NULL && PyCell_Check(f->localsplus[index]);
        return 1;
    }
    if (tag == 1 || tag == 3) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(target, 1)) || !PyDict_CheckExact(f->f_globals))
            return 0;
        return tag == 1 || f->f_locals == f->f_globals;
    }
    if (tag != 2)
        return 0;
    PyObject *subs = PyTuple_GET_ITEM(target, 1);
    /* a tuple or list, or a subclass iterating as one (a NamedTuple): what the statement's
     * unpacking reads, with no code of the value's own */
    int seq = (PyTuple_Check(value) && Py_TYPE(value)->tp_iter == PyTuple_Type.tp_iter) ||
              (PyList_Check(value) && Py_TYPE(value)->tp_iter == PyList_Type.tp_iter);
    if (!PyTuple_CheckExact(subs) || !seq ||
        PySequence_Fast_GET_SIZE(value) != PyTuple_GET_SIZE(subs))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(subs); i++)
        if (!binding_fits(f, PyTuple_GET_ITEM(subs, i), PySequence_Fast_GET_ITEM(value, i),
                          depth + 1))
            return 0;
    return 1;
}

/* The objects the names held before the binding: released once every name is bound and
 * signals are released (a release may run a finalizer, which then runs as it would at the
 * statement's own store, able to handle signals). */
#define OLDS_INLINE 16
typedef struct {
    PyObject *inline_items[OLDS_INLINE];
    Py_ssize_t n;
    PyObject *more; /* a list, past OLDS_INLINE */
} Olds;

static inline void
olds_init(Olds *olds) /* (its inline items are written before they are read) */
{
    olds->n = 0;
    olds->more = NULL;
}

static int
olds_add(Olds *olds, PyObject *old) /* steals ``old`` */
{
    if (olds->n < OLDS_INLINE) {
        olds->inline_items[olds->n++] = old;
        return 0;
    }
    if (olds->more == NULL && (olds->more = PyList_New(0)) == NULL) {
        Py_DECREF(old);
        return -1;
    }
    int r = PyList_Append(olds->more, old);
    Py_DECREF(old);
    return r;
}

static void
olds_release(Olds *olds)
{
    for (Py_ssize_t i = 0; i < olds->n; i++)
        Py_DECREF(olds->inline_items[i]);
    Py_XDECREF(olds->more);
}

/* Store ``value`` as ``target`` says (checked by ``binding_fits``); the objects the names held
 * go to ``olds``. -1: error. */
static int
binding_store(_PyInterpreterFrame *f, PyObject *target, PyObject *value, Olds *olds)
{
    long tag = PyLong_AsLong(PyTuple_GET_ITEM(target, 0));
    if (tag == 2) {
        PyObject *subs = PyTuple_GET_ITEM(target, 1);
        /* Every item taken first, as ``UNPACK_SEQUENCE`` puts them all on the stack: a store
         * into the globals can run Python code (a key's ``__eq__``) that changes a list. */
        PyObject *items = PySequence_Tuple(value);
        if (items == NULL)
            return -1;
        if (PyTuple_GET_SIZE(items) != PyTuple_GET_SIZE(subs)) {
            Py_DECREF(items);
            return -1; /* (changed since ``binding_fits``: the rest is left to the statement) */
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(subs); i++) {
            if (binding_store(f, PyTuple_GET_ITEM(subs, i), PyTuple_GET_ITEM(items, i), olds) <
                0) {
                Py_DECREF(items);
                return -1;
            }
        }
        Py_DECREF(items);
        return 0;
    }
    PyObject *old;
    if (tag == 0) {
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        if (PyTuple_GET_ITEM(target, 2) == Py_True) {
            PyObject *cell = f->localsplus[index];
            old = PyCell_GET(cell);
            PyCell_SET(cell, Py_NewRef(value));
        } else {
            old = f->localsplus[index];
            f->localsplus[index] = Py_NewRef(value);
        }
    } else {
        PyObject *name = PyTuple_GET_ITEM(target, 1);
        old = Py_XNewRef(PyDict_GetItemWithError(f->f_globals, name));
        if (old == NULL && PyErr_Occurred())
            return -1;
        if (PyDict_SetItem(f->f_globals, name, value) < 0) {
            Py_XDECREF(old);
            return -1;
        }
    }
    return old == NULL ? 0 : olds_add(olds, old);
}

/* Bind the statement's names to ``out`` (``binding``: the targets in the order the statement
 * stores them), or nothing where one target does not fit. Never raises. The objects the names
 * held go to ``olds``, which the caller releases once signals are (their finalizers then run
 * as on any thread that can handle signals, ``signal.signal`` included). */
static void
bind_targets(_PyInterpreterFrame *f, PyObject *binding, PyObject *out, Olds *olds)
{
    if (f == NULL || binding == NULL || !PyTuple_CheckExact(binding) ||
        PyTuple_GET_SIZE(binding) == 0)
        return;
    if (PyTuple_GET_SIZE(binding) == 1 && !PyErr_Occurred()) {
        /* ``x = f(...)`` into a function's local (not a cell): ``binding_store``'s own */
        PyObject *t = PyTuple_GET_ITEM(binding, 0);
        if (PyTuple_CheckExact(t) && PyTuple_GET_SIZE(t) == 3 &&
            PyTuple_GET_ITEM(t, 0) == local_tag && PyTuple_GET_ITEM(t, 2) != Py_True) {
            Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
            if (index >= 0 && index < f->f_code->co_nlocalsplus) {
                PyObject *old = f->localsplus[index];
                f->localsplus[index] = Py_NewRef(out);
                if (old != NULL)
                    olds_add(olds, old);
            }
            if (PyErr_Occurred())
                PyErr_Clear();
            return;
        }
    }
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    int had_error = PyErr_Occurred() != NULL;
    if (had_error)
        PyErr_Fetch(&type, &value, &tb);
    int fits = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(binding) && fits; i++)
        fits = binding_fits(f, PyTuple_GET_ITEM(binding, i), out, 0);
    if (fits) {
        Py_INCREF(out);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(binding); i++)
            if (binding_store(f, PyTuple_GET_ITEM(binding, i), out, olds) < 0)
                break;
        Py_DECREF(out);
    }
    if (PyErr_Occurred())
        PyErr_Clear();
    if (had_error)
        PyErr_Restore(type, value, tb);
}

/* After the Python path ran a call from frame ``f``: bind its statement's names when the
 * call's site donates and the statement calls this function with these arguments (its check's
 * identities, read again now: ``x = g(x)`` where ``g`` calls back into this function binds
 * nothing). */
static void
bind_after_python(CallPath *self, _PyInterpreterFrame *f, PyObject *args, PyObject *kwargs,
                  PyObject *out, Olds *olds)
{
    PyObject *site = NULL, *spec = NULL, *plans = NULL;
    if (trace_clean() <= 0 || !find_site(self, f, &site, &spec, &plans)) {
        PyErr_Clear();
        return;
    }
    PyObject *binding = Py_XNewRef(self->last_binding);
    int ok = 0;
    if (spec != NULL && binding != NULL && binding != Py_None) {
        if (spec != Py_None && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
            ok = run_spec(spec, f, (PyObject *)self, args, 1, NULL) == 1;
        } else { /* in Python (keywords too): ``proof.same_call(frame, callee, args, kwargs)`` */
            PyObject *proof = PyObject_GetAttr(site, s_proof);
            PyObject *check = proof ? PyObject_GetAttr(proof, s_same_call) : NULL;
            PyFrameObject *frame = check ? PyEval_GetFrame() : NULL; /* (f's, borrowed) */
            if (frame != NULL && frame->f_frame != f)
                frame = NULL;
            PyObject *r = frame ? PyObject_CallFunctionObjArgs(
                                      check, (PyObject *)frame, (PyObject *)self, args,
                                      kwargs ? kwargs : empty_dict, NULL)
                                : NULL;
            ok = r == Py_True;
            Py_XDECREF(r);
            Py_XDECREF(check);
            Py_XDECREF(proof);
        }
        if (PyErr_Occurred()) { /* (``same_call`` never raises: a signal handler's exception) */
            if (holding_here())
                hold_error();
            else
                PyErr_Clear();
        }
        if (ok)
            bind_targets(f, binding, out, olds);
    }
    Py_XDECREF(binding);
    Py_DECREF(site);
    Py_XDECREF(spec);
    Py_DECREF(plans);
}

#endif /* AUTOOPT_FAST */

/* ``type(self)._call(self, *args, **kwargs)``, as CPython calls a Python ``__call__``. */
static PyObject *
python_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *fn = _PyType_Lookup(Py_TYPE(self), s_call);
    if (fn == NULL) {
        PyErr_Format(PyExc_TypeError, "'%.200s' object is not callable",
                     Py_TYPE(self)->tp_name);
        return NULL;
    }
    Py_INCREF(fn);
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *small[8];
    PyObject **stack = small;
    if (n + 1 > 8) {
        stack = PyMem_Malloc((n + 1) * sizeof(PyObject *));
        if (stack == NULL) {
            Py_DECREF(fn);
            return PyErr_NoMemory();
        }
    }
    stack[0] = self;
    for (Py_ssize_t i = 0; i < n; i++)
        stack[i + 1] = PyTuple_GET_ITEM(args, i);
    PyObject *out = PyObject_VectorcallDict(fn, stack, n + 1, kwargs);
    if (stack != small)
        PyMem_Free(stack);
    Py_DECREF(fn);
    return out;
}

static PyObject *
cp_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
#if AUTOOPT_FAST
    CallPath *self = (CallPath *)op;
    if (self->mode == 2) { /* ``refs_in_call``: a lone argument's reference count */
        if (PyTuple_GET_SIZE(args) < 1)
            return PyErr_Format(PyExc_TypeError, "refs_in_call needs an argument");
        return PyLong_FromSsize_t(Py_REFCNT(PyTuple_GET_ITEM(args, 0)));
    }
    /* Under "safe": signals held, and the statement's names bound before returning (above):
     * on this path for a call that may donate, on the Python path for every call. */
    _PyInterpreterFrame *f = self->sites != NULL ? caller_frame() : NULL;
    if (self->mode == 1 && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
        PyObject *out = NULL, *binding = NULL;
        int held = 0;
        if (fast_call(self, f, args, &out, &binding, &held)) {
            Olds olds;
            olds_init(&olds);
            if (out == NULL)
                filter_error();
            else if (binding != NULL)
                bind_targets(f, binding, out, &olds);
            Py_XDECREF(binding);
            out = release_signals(held, out);
            olds_release(&olds);
            return out;
        }
        if (PyErr_Occurred()) /* not an Exception (``fall_back_error``): the caller's */
            return NULL;
    }
    int held = self->sites != NULL ? hold_signals() : 0;
    PyObject *out = python_call(op, args, kwargs);
    Olds olds;
    olds_init(&olds);
    if (out != NULL && f != NULL)
        bind_after_python(self, f, args, kwargs, out, &olds);
    out = release_signals(held, out);
    olds_release(&olds);
    return out;
#else
    return python_call(op, args, kwargs);
#endif
}

static PyObject *
cp_configure(PyObject *op, PyObject *const *a, Py_ssize_t n)
{
    /* (mode, sites, auto plans, caches, plain run): None for what does not apply */
    if (n != 5)
        return PyErr_Format(PyExc_TypeError, "_native_configure takes 5 arguments");
#if AUTOOPT_FAST
    CallPath *self = (CallPath *)op;
    int mode = (int)PyLong_AsLong(a[0]);
    if (mode == -1 && PyErr_Occurred())
        return NULL;
    cp_clear(self);
    if (mode == 1 && refs_base < 0)
        mode = 0; /* not configured (``configure``): the Python path */
    self->sites = a[1] == Py_None ? NULL : Py_NewRef(a[1]);
    self->auto_plans = a[2] == Py_None ? NULL : Py_NewRef(a[2]);
    self->caches = Py_NewRef(a[3]);
    self->plain_run = a[4] == Py_None ? NULL : Py_NewRef(a[4]);
    if ((self->sites != NULL && !PyDict_CheckExact(self->sites)) ||
        (self->auto_plans != NULL && !PyDict_CheckExact(self->auto_plans)))
        mode = 0;
    self->mode = mode;
#endif
    Py_RETURN_NONE;
}

static PyMethodDef cp_methods[] = {
    {"_native_configure", (PyCFunction)(void (*)(void))cp_configure, METH_FASTCALL,
     "Set what the C call path reads: (mode, sites, auto plans, caches, plain run)."},
    {NULL},
};

static PyTypeObject CallPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "autoopt._jit._native.CallPath",
#if AUTOOPT_FAST
    .tp_basicsize = sizeof(CallPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)cp_traverse,
    .tp_clear = (inquiry)cp_clear,
    .tp_dealloc = (destructor)cp_dealloc,
    .tp_free = PyObject_GC_Del,
#else
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
#endif
    .tp_new = PyType_GenericNew,
    .tp_call = cp_call,
    .tp_methods = cp_methods,
    .tp_doc = "The cached call path of an OptimizedFunction (see autoopt/_jit/_native.c).",
};

#if AUTOOPT_FAST
static PyObject *
configure(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    if (n != 17)
        return PyErr_Format(PyExc_TypeError, "configure takes 17 arguments");
    PyObject **slots[] = {&trace_state, &eval_trace,         &axis_env,   &top_axis_env,
                          &debug_nans,  &debug_infs,         &array_type, &plain_types,
                          &other_code_may_run, &fit_check_type, &first_call,
                          &filter_traceback,   &miss};
    for (int i = 0; i < 13; i++)
        Py_XSETREF(*slots[i], Py_NewRef(a[i]));
    if (!PyFrozenSet_Check(plain_types))
        return PyErr_Format(PyExc_TypeError, "plain types must be a frozenset");
    refs_base = PyLong_AsSsize_t(a[13]);
    if (refs_base == -1 && PyErr_Occurred())
        return NULL;
    /* (getter of each state's ``.value``, in the order above), ``aval``'s getter, is_deleted:
     * None where the attribute is not a plain property or method of the type */
    if (!PyTuple_Check(a[14]) || PyTuple_GET_SIZE(a[14]) != 4)
        return PyErr_Format(PyExc_TypeError, "value getters must be a 4-tuple");
    for (int i = 0; i < 4; i++) {
        PyObject *g = PyTuple_GET_ITEM(a[14], i);
        Py_XSETREF(value_getter[i], g == Py_None ? NULL : Py_NewRef(g));
    }
    Py_XSETREF(aval_getter, a[15] == Py_None ? NULL : Py_NewRef(a[15]));
    Py_XSETREF(is_deleted_fn, a[16] == Py_None ? NULL : Py_NewRef(a[16]));
    Py_RETURN_NONE;
}

static PyObject *
configure_nested(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3 || !PySet_Check(a[0]) || !PyFrozenSet_Check(a[1]) || !PyFrozenSet_Check(a[2]))
        return PyErr_Format(PyExc_TypeError,
                            "configure_nested takes (a set of NamedTuple types, a frozenset of "
                            "NumPy leaf types, a frozenset of scalar types)");
    Py_XSETREF(namedtuple_types, Py_NewRef(a[0]));
    Py_XSETREF(host_leaf_types, Py_NewRef(a[1]));
    Py_XSETREF(scalar_types, Py_NewRef(a[2]));
    Py_RETURN_NONE;
}

/* For tests and the calibration: ``nested_key(args)`` (None where ``nested_key`` reads no
 * signature) and ``shared_walk(obj)``. */
static PyObject *
nested_key_py(PyObject *module, PyObject *args)
{
    if (!PyTuple_Check(args) || namedtuple_types == NULL)
        return PyErr_Format(PyExc_TypeError, "nested_key takes a tuple, once configured");
    PyObject *key = nested_key(args);
    if (key == NOT_NESTED)
        Py_RETURN_NONE;
    return key;
}

static PyObject *
shared_walk_py(PyObject *module, PyObject *obj)
{
    if (namedtuple_types == NULL)
        return PyErr_Format(PyExc_TypeError, "shared_walk needs configure_nested first");
    int r = shared_walk(obj, 0);
    return r < 0 ? NULL : PyLong_FromLong(r);
}

/* ``unwrap_held(j)``: the jit object a ``HoldsSignals`` wraps, else ``j``. */
static PyObject *
unwrap_held(PyObject *module, PyObject *j)
{
    if (Py_TYPE(j) == &HoldsSignalsType)
        return Py_NewRef(((HoldsSignals *)j)->inner);
    return Py_NewRef(j);
}

/* In a child forked while a call held signals: no call of this process holds them (the
 * child's main thread is the one that forked; CPython resets ``main_thread`` to it). */
static PyObject *
after_fork(PyObject *module, PyObject *unused)
{
    held_depth = 0;
    sealed_at = 0;
    held_tstate = NULL;
    deep_on = 0;
    Py_CLEAR(held_type);
    Py_CLEAR(held_value);
    Py_CLEAR(held_tb);
    Py_RETURN_NONE;
}

/* ``held_call(body, frame, binding)``: for the call paths written in Python (a decorated
 * method's, equinox's and nnx's), what ``cp_call`` does around a call: ``body()`` with signals
 * held, and its result bound to the names of the statement running in ``frame`` (None: no
 * names to bind) before they are released. In C, so that no handler can run between the hold
 * and the call, or between the binding and the release. */
static PyObject *
held_call(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3)
        return PyErr_Format(PyExc_TypeError, "held_call takes (body, frame, binding)");
    int held = hold_signals();
    PyObject *out = PyObject_CallNoArgs(a[0]);
    Olds olds;
    olds_init(&olds);
    if (out != NULL && PyFrame_Check(a[1]) && a[2] != Py_None) {
        _PyInterpreterFrame *f = ((PyFrameObject *)a[1])->f_frame;
        if (f != NULL && f->owner != FRAME_OWNED_BY_FRAME_OBJECT) /* (still running) */
            bind_targets(f, a[2], out, &olds);
    }
    out = release_signals(held, out);
    olds_release(&olds);
    return out;
}

static PyObject *
catching(PyObject *module, PyObject *unused)
{
    PyThreadState *ts = PyThreadState_GET();
    for (int i = 0; i < catching_used; i++)
        if (catching_threads[i] == ts && catching_depth[i] > 0)
            Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}
#endif

static PyMethodDef module_methods[] = {
#if AUTOOPT_FAST
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "The objects every call reads, the measured reference count of a lone argument, and the "
     "functions behind the attributes it reads."},
    {"configure_nested", (PyCFunction)(void (*)(void))configure_nested, METH_FASTCALL,
     "callsite.nested_signature's tables: NamedTuple types (the set callsite fills), NumPy leaf "
     "types, scalar types."},
    {"nested_key", nested_key_py, METH_O, "callsite.nested_signature(args)[0], read in C."},
    {"shared_walk", shared_walk_py, METH_O,
     "1: a part is referenced from elsewhere, 0: none is, 2: a node only Python reads."},
    {"suspend_deep", suspend_deep, METH_NOARGS,
     "As a trace of the wrapper starts inside a call holding signals: let handlers run."},
    {"resume_deep", resume_deep, METH_O, "As that trace ends: suspend_deep's result."},
    {"held_call", (PyCFunction)(void (*)(void))held_call, METH_FASTCALL,
     "body() with signals held, its result bound to the frame's statement's names (binding)."},
    {"unwrap_held", unwrap_held, METH_O, "The jit object a HoldsSignals wraps, else itself."},
    {"after_fork", after_fork, METH_NOARGS, "In a forked child: no call holds signals."},
    {"catching", catching, METH_NOARGS,
     "Whether this thread is inside a plan's executable run from C (``_fit.caught_here``)."},
#endif
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "autoopt._jit._native",
    "The cached call path of OptimizedFunction in C (CPython 3.11).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    s_call = PyUnicode_InternFromString("_call");
    if (s_call == NULL)
        return NULL;
#if AUTOOPT_FAST
    s_value = PyUnicode_InternFromString("value");
    local_tag = PyLong_FromLong(0); /* (CPython's small int: every 0 a binding holds) */
    s_donates = PyUnicode_InternFromString("donates");
    s_plans = PyUnicode_InternFromString("plans");
    s_proof = PyUnicode_InternFromString("proof");
    s_slot_spec = PyUnicode_InternFromString("slot_spec");
    s_binding = PyUnicode_InternFromString("binding");
    s_same_call = PyUnicode_InternFromString("same_call");
    s_lookup_plain = PyUnicode_InternFromString("lookup_plain");
    s_native = PyUnicode_InternFromString("_native");
    s_is_deleted = PyUnicode_InternFromString("is_deleted");
    s_fit_escaped = PyUnicode_InternFromString("_fit_escaped");
    s_aval = PyUnicode_InternFromString("aval");
    s_shape = PyUnicode_InternFromString("shape");
    s_dtype = PyUnicode_InternFromString("dtype");
    empty_dict = PyDict_New();
    sealed_retrace = PyErr_NewException("autoopt._jit._native.SealedRetrace", PyExc_BaseException,
                                        NULL);
    if (!sealed_retrace || !s_value || !s_donates || !s_plans || !s_proof || !s_slot_spec || !s_binding ||
        !s_same_call || !s_lookup_plain ||
        !s_native || !s_is_deleted || !s_fit_escaped || !s_aval || !s_shape || !s_dtype ||
        !empty_dict)
        return NULL;
#endif
    if (PyType_Ready(&CallPathType) < 0)
        return NULL;
#if AUTOOPT_FAST
    if (PyType_Ready(&HoldsSignalsType) < 0)
        return NULL;
#endif
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "CallPath", (PyObject *)&CallPathType) < 0 ||
        PyModule_AddObjectRef(m, "SUPPORTED", AUTOOPT_FAST ? Py_True : Py_False) < 0
#if AUTOOPT_FAST
        || PyModule_AddObjectRef(m, "HoldsSignals", (PyObject *)&HoldsSignalsType) < 0
#endif
    ) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
