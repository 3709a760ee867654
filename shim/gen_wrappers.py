"""Generate the shim's NCCL wrappers, and the table of how it treats each call, from native/nccl.h.

Each prototype between "BEGIN API" and "END API" becomes:
  - a pointer in struct pitstop_nccl (build/real.h): the real definition in one loaded NCCL
    library.  The shim keeps one such table per libnccl the program reaches (nccl_shim.h
    pitstop_libs): slot 0 for the calls that reach it by name through the PLT, another slot for
    each further copy the program reaches through dlsym (shim/dl.c);
  - an exported <name> (slot 0) and a static <name>_<k> per further slot (handed back by the
    shim's dlsym), which, by the call's kind in TREATMENT below,
      create      make a communicator behind a handle of the shim's (shim.c), re-created at a rebuild
                  (a reduction operator likewise, behind the value the program was given),
      end         end one (shim.c),
      group       keep groups whole at a cut,
      status      translate the handle; "no error" while the real one is down,
      operation   (takes a stream) translate the handle, pass the quiesce check, count, call; a
                  communicator error in a job that snapshots protect parks the rank for its recovery,
      query       translate the handle,
      unmovable   translate the handle, and mark the process unmovable: the call leaves state in the
                  real communicator that a rebuild would not re-create,
      pass        pass straight through: no communicator.
A communicator's calls go to the library that made it, whichever entry they come through.

Usage: gen_wrappers.py HEADER OUTDIR     writes OUTDIR/real.h and OUTDIR/wrappers.c
       gen_wrappers.py HEADER --table    prints the table docs/architecture.md carries (tests/test_shim.py
                                         checks that the two agree)
"""

from __future__ import annotations

import re
import sys
import zlib
from pathlib import Path

MAX_LIBS = 4  # NCCL libraries one process may reach (nccl_shim.h PITSTOP_MAX_LIBS)

# How the shim treats each call: (kind, why).  The table in docs/architecture.md is printed from this.
_NOCOMM = "no communicator in it"
_REGISTERED = ("lives in the real communicator; a re-created one would not have it and the handle the "
               "program holds would name nothing")
TREATMENT: dict[str, tuple[str, str]] = {
    "ncclGetVersion": ("pass", _NOCOMM),
    "ncclGetUniqueId": ("pass", "an id only names a rendezvous; the shim makes fresh ones for a rebuild"),
    "ncclGetErrorString": ("pass", _NOCOMM),
    "ncclGetLastError": ("status", "the real communicator's last error"),
    "ncclCommInitRank": ("create", "re-created with a fresh id, same ranks"),
    "ncclCommInitRankConfig": ("create", "re-created with a fresh id and the caller's whole config"),
    "ncclCommInitRankScalable": ("create", "re-created with one fresh id (the roots only spread the bootstrap)"),
    "ncclCommSplit": ("create", "replayed on the re-created parent in creation order, NOCOLOR too"),
    "ncclCommFinalize": ("end", "flushes the real communicator"),
    "ncclCommDestroy": ("end", "the handle ends; nothing to re-create"),
    "ncclCommAbort": ("end", "the handle ends; nothing to re-create"),
    "ncclCommCount": ("query", "read from the real communicator"),
    "ncclCommUserRank": ("query", "read from the real communicator"),
    "ncclCommCuDevice": ("query", "read from the real communicator"),
    "ncclCommGetAsyncError": ("status", "answers \"no error\" while the real communicator is down at a cut"),
    "ncclAllReduce": ("operation", "counted; the cut balances it"),
    "ncclBroadcast": ("operation", "counted; the cut balances it"),
    "ncclReduce": ("operation", "counted; the cut balances it"),
    "ncclAllGather": ("operation", "counted; the cut balances it"),
    "ncclReduceScatter": ("operation", "counted; the cut balances it"),
    "ncclSend": ("operation", "counted per peer; the cut balances each channel"),
    "ncclRecv": ("operation", "counted per peer; the cut balances each channel"),
    "ncclGroupStart": ("group", "a group is checked at its first operation, so it stays whole"),
    "ncclGroupEnd": ("group", "a group is checked at its first operation, so it stays whole"),
    "ncclCommInitAll": ("unmovable", "one process drives several devices' ranks; the shim re-creates one "
                                     "rank per process"),
    "ncclCommShrink": ("unmovable", "the new communicator leaves ranks out (failed ones, often) that a "
                                    "replay could not reach; its handle is NCCL's own"),
    "ncclCommGetUniqueId": ("unmovable", "an id to grow the communicator by ranks the job did not start with"),
    "ncclCommGrow": ("unmovable", "adds ranks the job did not start with; the new handle is NCCL's own"),
    "ncclCommRevoke": ("unmovable", "a re-created communicator would not be revoked"),
    "ncclCommSuspend": ("unmovable", "a re-created communicator would not be suspended"),
    "ncclCommResume": ("query", "follows a suspend, which already made the job unmovable"),
    "ncclCommMemStats": ("query", "read from the real communicator"),
    "ncclBcast": ("operation", "counted; the cut balances it"),
    "ncclAlltoAll": ("operation", "counted; the cut balances it"),
    "ncclGather": ("operation", "counted; the cut balances it"),
    "ncclScatter": ("operation", "counted; the cut balances it"),
    "ncclPutSignal": ("unmovable", "one-sided, on a registered window: no count on both sides to balance"),
    "ncclSignal": ("unmovable", "one-sided: no count on both sides to balance"),
    "ncclWaitSignal": ("unmovable", "one-sided: no count on both sides to balance"),
    "ncclGroupSimulateEnd": ("group", "ends the group like ncclGroupEnd, launching nothing"),
    "ncclCommRegister": ("unmovable", "a buffer registration " + _REGISTERED),
    "ncclCommDeregister": ("query", "follows a registration, which already made the job unmovable"),
    "ncclCommWindowRegister": ("unmovable", "a window " + _REGISTERED),
    "ncclCommWindowDeregister": ("query", "follows a window, which already made the job unmovable"),
    "ncclWinGetUserPtr": ("query", "follows a window, which already made the job unmovable"),
    "ncclRedOpCreatePreMulSum": ("create", "recorded with its scalar (the value, or the device pointer) and made "
                                           "again on the rebuilt communicator; the value the program holds is "
                                           "translated to NCCL's new one in the calls that take an operator"),
    "ncclRedOpDestroy": ("end", "the operator ends: nothing of it to make again"),
    "ncclDevCommCreate": ("unmovable", "a device communicator lives in memory the job's own kernels use"),
    "ncclDevCommDestroy": ("query", "follows a device communicator, which already made the job unmovable"),
    "ncclMemAlloc": ("pass", "device memory, not a communicator: it moves with the rest of the process's"),
    "ncclMemFree": ("pass", "device memory, not a communicator"),
    "ncclResetDebugInit": ("pass", "logging only"),
    "ncclParamDumpAll": ("pass", "parameters only"),
}
for _p in ("Bind", "GetI8", "GetI16", "GetI32", "GetI64", "GetU8", "GetU16", "GetU32", "GetU64", "GetStr", "Get",
           "GetParameter", "GetAllParameterKeys"):
    TREATMENT[f"ncclParam{_p}"] = ("pass", "parameters only")

# The NCCL release each call first appeared in, where after 2.17 (read from NVIDIA/nccl's
# src/nccl.h.in at each release tag; the device API's host calls from nccl_device/core.h).
SINCE = {"ncclCommSplit": "2.18", "ncclCommRegister": "2.19", "ncclCommDeregister": "2.19", "ncclMemAlloc": "2.19",
         "ncclMemFree": "2.19", "ncclGroupSimulateEnd": "2.22", "ncclCommInitRankScalable": "2.23",
         "ncclResetDebugInit": "2.24", "ncclCommShrink": "2.27", "ncclCommWindowRegister": "2.27",
         "ncclCommWindowDeregister": "2.27", "ncclAlltoAll": "2.28", "ncclGather": "2.28", "ncclScatter": "2.28",
         "ncclCommRevoke": "2.28", "ncclDevCommCreate": "2.28", "ncclDevCommDestroy": "2.28",
         "ncclCommGetUniqueId": "2.29", "ncclCommGrow": "2.29", "ncclCommSuspend": "2.29", "ncclCommResume": "2.29",
         "ncclCommMemStats": "2.29", "ncclPutSignal": "2.29", "ncclSignal": "2.29", "ncclWaitSignal": "2.29",
         "ncclWinGetUserPtr": "2.29"}
SINCE |= {n: "2.30" for n in TREATMENT if n.startswith("ncclParam")}

LIFECYCLE = {
    "ncclCommInitRank": "return pitstop_init(L, comm, nranks, commId, rank, NULL, 0);",
    "ncclCommInitRankConfig": "return pitstop_init(L, comm, nranks, commId, rank, config, 1);",
    "ncclCommInitRankScalable": "return pitstop_init_scalable(L, newcomm, nranks, myrank, nId, commIds, config);",
    "ncclCommSplit": "return pitstop_split(L, comm, color, key, newcomm, config);",
    "ncclCommDestroy": "return pitstop_destroy(L, comm, 0);",
    "ncclCommAbort": "return pitstop_destroy(L, comm, 1);",
    "ncclCommFinalize": "return pitstop_destroy(L, comm, 2);",
    "ncclGroupStart": "pitstop_group_start();\n  return L->fn.ncclGroupStart();",
    "ncclGroupEnd": "if (pitstop_ctl) pitstop_ctl->in_call = 1;\n  ncclResult_t r = L->fn.ncclGroupEnd();\n"
                    "  if (pitstop_ctl) pitstop_ctl->in_call = 0;\n  pitstop_group_end();\n"
                    "  if (__builtin_expect(r != ncclSuccess, 0)) r = pitstop_peer_lost(NULL, r, \"ncclGroupEnd\");\n"
                    "  return r;",
    "ncclGroupSimulateEnd": "ncclResult_t r = L->fn.ncclGroupSimulateEnd(simInfo);\n  pitstop_group_end();\n"
                            "  return r;",
    "ncclGetLastError": "struct vcomm *v = pitstop_v(comm);\n"
                        "  if (v) { pitstop_in = v->lib; return v->lib->fn.ncclGetLastError(v->real); }\n"
                        "  return L->fn.ncclGetLastError(comm);",
    "ncclCommGetAsyncError": "return pitstop_async_error(L, comm, asyncError);",
    "ncclRedOpCreatePreMulSum": "return pitstop_redop_create(L, op, scalar, datatype, residence, comm);",
    "ncclRedOpDestroy": "return pitstop_redop_destroy(L, op, comm);",
}

# Present in every NCCL the shim supports (2.17+); every other pointer may be NULL.
REQUIRED = {"ncclGetVersion", "ncclGetUniqueId", "ncclGetErrorString", "ncclGetLastError", "ncclCommInitRank",
            "ncclCommInitRankConfig", "ncclCommSplit", "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort",
            "ncclCommCount", "ncclCommUserRank", "ncclCommCuDevice", "ncclCommGetAsyncError", "ncclAllReduce",
            "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv",
            "ncclGroupStart", "ncclGroupEnd"}

PROTO = re.compile(r"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>nccl\w+)\((?P<params>.*)\);$")
KINDS = ("create", "end", "group", "status", "operation", "query", "unmovable", "pass")
WHAT = {"create": "wrapped: made behind a shim handle, re-created at a rebuild",
        "end": "wrapped: ends the handle", "group": "wrapped: group kept whole",
        "status": "wrapped: handle translated", "operation": "wrapped: counted, gated at the cut",
        "query": "wrapped: handle translated", "unmovable": "makes the job unmovable",
        "pass": "passes through"}


def parse(header: str) -> list[dict]:
    text = header.split("BEGIN API", 1)[1].split("END API", 1)[0]
    out = []
    for line in text.splitlines():
        line = line.strip()
        m = PROTO.match(line)
        if not m:
            continue
        params = []
        raw = m.group("params").strip()
        if raw and raw != "void":
            for p in raw.split(","):
                p = p.strip()
                pname = re.findall(r"[A-Za-z_]\w*", p)[-1]
                params.append((p, pname))
        out.append({"ret": m.group("ret").strip(), "name": m.group("name"), "params": params, "raw": raw or "void"})
    return out


def category(f: dict) -> str:
    try:
        return TREATMENT[f["name"]][0]
    except KeyError:
        sys.exit(f"gen_wrappers: {f['name']} is in the header but not in TREATMENT: say how the shim treats it")


def signature(name: str) -> int:
    """A constant per NCCL function for the shim's trail of operations (fastpath.h pitstop_count)."""
    return zlib.crc32(name.encode())


def _fail(f: dict) -> str:
    """What a call answers when no NCCL lies behind the shim; a string function never returns NULL
    (callers such as PyTorch build a std::string from it)."""
    if f["ret"] == "void":
        return "return;"
    return "return PITSTOP_NO_NCCL_MSG;" if "char" in f["ret"] else "return ncclSystemError;"


def _call(lib: str, f: dict, args: str) -> str:
    """An expression calling f in library `lib` (a struct pitstop_lib *), guarded where the library
    may predate the call."""
    c = f"{lib}->fn.{f['name']}({args})"
    if f["name"] in REQUIRED or f["ret"] == "void":
        return c
    return f"({lib}->fn.{f['name']} ? {c} : pitstop_missing(\"{f['name']}\"))"


def _is_comm(param: str) -> bool:
    return re.search(r"\bncclComm_t\s+comm$", param) is not None


def _body(f: dict) -> list[str]:
    name, cat = f["name"], category(f)
    args = ", ".join(n for _, n in f["params"])
    has_comm = any(_is_comm(p) for p, _ in f["params"])  # a communicator by value (not ncclComm_t *comm)
    real_args = ", ".join("v->real" if _is_comm(p) else n for p, n in f["params"])
    foreign = [f"  if (!v) {{ struct pitstop_lib *T = pitstop_foreign(\"{name}\", comm, L); "
               f"return {_call('T', f, args)}; }}"]
    if name in LIFECYCLE:
        return ["  " + LIFECYCLE[name]]
    if cat == "operation":
        names = [n for _, n in f["params"]]
        op, peer = ("OP_COLL", "-1")
        count = next((f"(uint64_t){n}" for n in names if n.lower().endswith("count")), "0")
        dtype = "(int)datatype" if "datatype" in names else "0"
        if "peer" in names:  # point to point: counted per peer, in its direction
            op, peer = ("OP_SEND" if name.endswith("Send") else "OP_RECV"), "peer"
        # an operator the program made: NCCL's value for it on the current communicator (fastpath.h)
        redop = ["  op = pitstop_redop(v, op);"] if "op" in names else []
        return ["  struct vcomm *v = pitstop_v(comm);", *foreign,
                f"  ncclResult_t q = pitstop_enter(v, {op}, {peer});", "  if (q != ncclSuccess) return q;",
                "  if (!v->real) return ncclInvalidUsage;", *redop,
                f"  pitstop_count(v, {op}, {peer}, {signature(name)}u, {count}, {dtype});",
                "  pitstop_ctl->in_call = 1;", "  pitstop_in = v->lib;",
                f"  ncclResult_t r = {_call('v->lib', f, real_args)};",
                "  pitstop_ctl->in_call = 0;",
                # a peer's failure, in a job that snapshots protect: parked for its recovery (shim.c)
                f"  if (__builtin_expect(r != ncclSuccess, 0)) r = pitstop_peer_lost(v, r, \"{name}\");",
                "  return r;"]
    if cat == "query":
        return ["  struct vcomm *v = pitstop_v(comm);", *foreign,
                "  pthread_mutex_lock(&pitstop_real_lock);", "  pitstop_in = v->lib;",
                f"  ncclResult_t r = v->real ? {_call('v->lib', f, real_args)} : ncclInvalidArgument;",
                "  pthread_mutex_unlock(&pitstop_real_lock);", "  return r;"]
    if cat == "unmovable":
        # No lock: these may block for a whole collective (window registration, shrink), and the
        # job they mark is never cut, so its real communicators are never swapped under them.
        mark = [f"  pitstop_unmovable(\"{name}\", \"{TREATMENT[name][1]}\");"]
        if not has_comm:
            return [*mark, f"  return {_call('L', f, args)};"]
        return [*mark, "  struct vcomm *v = pitstop_v(comm);", *foreign, "  pitstop_in = v->lib;",
                f"  return {_call('v->lib', f, real_args)};"]
    raise ValueError(cat)


def generate(funcs: list[dict]) -> tuple[str, str]:
    real_h = ["/* generated by shim/gen_wrappers.py from native/nccl.h: do not edit */",
              "#ifndef PITSTOP_SHIM_REAL_H", "#define PITSTOP_SHIM_REAL_H",
              "/* One loaded NCCL library's real functions (NULL: that library predates the call). */",
              "struct pitstop_nccl {"]
    for f in funcs:
        real_h.append(f"  {f['ret']} (*{f['name']})({f['raw']});")
    real_h += ["};", f"#define PITSTOP_NFUNCS {len(funcs)}", f"#define PITSTOP_GEN_MAX_LIBS {MAX_LIBS}",
               "struct pitstop_lib;",
               "/* The API's names, and each slot's entry points in the same order (dl.c hands them out). */",
               "extern const char *const pitstop_api_names[PITSTOP_NFUNCS];",
               "extern const unsigned char pitstop_api_passes[PITSTOP_NFUNCS]; /* 1: passes through (no communicator) */",
               "extern void *const pitstop_entries[PITSTOP_GEN_MAX_LIBS][PITSTOP_NFUNCS];",
               "/* Fill a library's table through sym(ctx, name); 0 when it has NCCL's core calls. */",
               "int pitstop_fill(struct pitstop_lib *L, void *(*sym)(void *ctx, const char *name), void *ctx);",
               "#endif", ""]

    c = ["/* generated by shim/gen_wrappers.py from native/nccl.h: do not edit */", "#define _GNU_SOURCE",
         '#include "../fastpath.h"', "#include <stdio.h>", "",
         "const char *const pitstop_api_names[PITSTOP_NFUNCS] = {",
         *[f"  \"{f['name']}\"," for f in funcs], "};", "",
         "const unsigned char pitstop_api_passes[PITSTOP_NFUNCS] = {",
         "  " + ", ".join("1" if category(f) == "pass" else "0" for f in funcs), "};", "",
         "int pitstop_fill(struct pitstop_lib *L, void *(*sym)(void *ctx, const char *name), void *ctx) {"]
    for f in funcs:
        c.append(f"  L->fn.{f['name']} = ({f['ret']} (*)({f['raw']}))sym(ctx, \"{f['name']}\");")
    c += ["  return L->fn.ncclCommInitRank && L->fn.ncclAllReduce && L->fn.ncclGetVersion ? 0 : -1;", "}", ""]
    for f in funcs:
        name, ret, raw, cat = f["name"], f["ret"], f["raw"], category(f)
        args = ", ".join(n for _, n in f["params"])
        lparams = f"struct pitstop_lib *L, {raw}" if raw != "void" else "struct pitstop_lib *L"
        largs = f"L, {args}" if args else "L"
        inline = "static inline __attribute__((always_inline))"
        entry = [f"  if (__builtin_expect(!__atomic_load_n(&L->ready, __ATOMIC_ACQUIRE), 0) && pitstop_resolve(L) != 0) "
                 f"{_fail(f)}"]
        if name not in REQUIRED and ret != "void":  # newer calls: the NCCL behind the shim may predate them
            entry.append(f"  if (!L->fn.{name}) return pitstop_missing(\"{name}\");")
        elif name not in REQUIRED:
            entry.append(f"  if (!L->fn.{name}) {{ pitstop_missing(\"{name}\"); return; }}")
        c.append(f"/* {name}: {cat} */")
        if cat == "pass":
            # NCCL's own call through the PLT goes back to the NCCL under way.
            pick = "  struct pitstop_lib *T = pitstop_in ? pitstop_in : L;"
            call = (f"  if (T->fn.{name}) T->fn.{name}({args});" if ret == "void"
                    else f"  return {_call('T', f, args)};")
            c += [f"{inline} {ret} entry_{name}({lparams}) {{", *entry, pick, call, "}"]
        else:
            # NCCL calls its own public API through the PLT (a blocking init polls
            # ncclCommGetAsyncError, for one), and the preloaded shim is first in line: such a call,
            # made while this thread is inside the shim, goes straight to the library under way.
            assert ret != "void", name  # only "pass" calls return nothing
            reenter = f"  if (pitstop_in) {{ struct pitstop_lib *T = pitstop_in; return {_call('T', f, args)}; }}"
            c += [f"{inline} {ret} shim_{name}({lparams}) {{", *_body(f), "}",
                  f"{inline} {ret} entry_{name}({lparams}) {{", *entry, reenter, "  pitstop_in = L;",
                  f"  {ret} r = shim_{name}({largs});", "  pitstop_in = NULL;", "  return r;", "}"]
        for k in range(MAX_LIBS):
            body = f"entry_{name}(&pitstop_libs[{k}]{', ' + args if args else ''})"
            c.append(f"static {ret} {name}_{k}({raw}) {{ {'' if ret == 'void' else 'return '}{body}; }}")
        c += [f"{ret} {name}({raw}) __attribute__((alias(\"{name}_0\")));", ""]
    c += ["void *const pitstop_entries[PITSTOP_GEN_MAX_LIBS][PITSTOP_NFUNCS] = {"]
    for k in range(MAX_LIBS):
        c.append("  {" + ", ".join(f"(void *){f['name']}_{k}" for f in funcs) + "},")
    c += ["};", ""]
    return "\n".join(real_h), "\n".join(c)


def table(funcs: list[dict]) -> str:
    """The markdown table docs/architecture.md carries: every call, since when, what the shim does, why."""
    rows = ["| call | since | the shim | why |", "|---|---|---|---|"]
    order = {k: i for i, k in enumerate(KINDS)}
    for f in sorted(funcs, key=lambda f: (order[category(f)], f["name"])):
        kind, why = TREATMENT[f["name"]]
        rows.append(f"| `{f['name']}` | {SINCE.get(f['name'], '2.17')} | {WHAT[kind]} | {why} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    header = Path(sys.argv[1])
    funcs = parse(header.read_text())
    if len(funcs) < 20:
        sys.exit(f"gen_wrappers: only {len(funcs)} prototypes found in {header}")
    extra = sorted(set(TREATMENT) - {f["name"] for f in funcs})
    if extra:
        sys.exit(f"gen_wrappers: TREATMENT names calls the header lacks: {', '.join(extra)}")
    if sys.argv[2] == "--table":
        sys.stdout.write(table(funcs))
        return
    outdir = Path(sys.argv[2])
    real_h, wrappers = generate(funcs)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "real.h").write_text(real_h)
    (outdir / "wrappers.c").write_text(wrappers)
    print(f"gen_wrappers: {len(funcs)} wrappers, {MAX_LIBS} slots "
          f"({', '.join(f'{k}: {sum(category(f) == k for f in funcs)}' for k in KINDS)})")


if __name__ == "__main__":
    main()
