import time, numpy as np
from psctl.proto import psctl_pb2 as pb
from psctl.runtime import wire
from psctl.runtime.wire import Entry, DENSE
from psctl.runtime.optimizers import make_optimizer
from google.protobuf.internal import api_implementation
print("protobuf impl", api_implementation.Type())
def t(label, fn, n=10):
    fn()
    ts=[]
    for _ in range(n):
        s=time.perf_counter(); fn(); ts.append(time.perf_counter()-s)
    ts.sort(); print(f"{label:40s} {ts[len(ts)//2]*1e3:8.2f} ms")
for mib in (8, 64):
    n = mib<<20
    a = np.full(n//4, 1e-6, dtype=np.float32)
    print("== size", mib)
    t("tobytes", lambda: a.tobytes())
    b = a.tobytes()
    def mk():
        tt = pb.Tensor(); tt.data = b; return tt
    t("assign bytes field", mk)
    tt = mk()
    t("access .data", lambda: tt.data)
    t("to_tensor", lambda: wire.to_tensor(a))
    req = pb.PushRequest(); wire.add_entries(req.entries, [Entry("v", DENSE, a)])
    t("add_entries (PushRequest)", lambda: wire.add_entries(pb.PushRequest().entries, [Entry("v", DENSE, a)]))
    t("SerializeToString", lambda: req.SerializeToString())
    s = req.SerializeToString()
    t("FromString", lambda: pb.PushRequest.FromString(s))
    r2 = pb.PushRequest.FromString(s)
    t("decode_entries", lambda: wire.decode_entries(r2.entries))
    t("from_tensor", lambda: wire.from_tensor(r2.entries[0].tensor))
    t("isfinite all", lambda: np.isfinite(a).all())
    opt = make_optimizer("sgd", 0.01, {})
    var = np.zeros_like(a); slots = opt.create_slots(var)
    t("sgd apply_dense", lambda: opt.apply_dense(var, a, slots))
    t("chunks (iter_chunks)", lambda: list(wire.iter_chunks([Entry("v", DENSE, a)])))
    chunks = list(wire.iter_chunks([Entry("v", DENSE, a)]))
    msgs = []
    for g in chunks:
        p = pb.PushRequest(); p.entries.extend(g); msgs.append(pb.PushChunk(part=p))
    t("build chunk msgs", lambda: [pb.PushChunk(part=pb.PushRequest(entries=g)) for g in chunks])
    t("serialize chunks", lambda: [m.SerializeToString() for m in msgs])
    ser = [m.SerializeToString() for m in msgs]
    t("parse chunks", lambda: [pb.PushChunk.FromString(x) for x in ser])
    parsed = [pb.PushChunk.FromString(x) for x in ser]
    def asm():
        A = wire.Assembler()
        for m in parsed: A.add(m.part.entries)
        return A.entries()
    t("assemble", asm)
    t("memcpy", lambda: np.copyto(var, a))
