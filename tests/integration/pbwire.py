"""pbwire - just enough of the protobuf wire format to speak scape.proto
from tests without generated code: encode Requests, decode Replies.

Field numbers follow proto/scape.proto; a mismatch shows up as a daemon
refusal in the tests, not as silent agreement."""
import struct

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


def varint(n):
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wtype, payload):
    key = varint((num << 3) | wtype)
    if wtype == VARINT:
        return key + varint(payload)
    if wtype == FIXED32:
        return key + struct.pack("<f", payload)
    if wtype == LEN:
        if isinstance(payload, str):
            payload = payload.encode()
        return key + varint(len(payload)) + payload
    raise ValueError(wtype)


def hello(pid, protocol=1, name="probe", index=-1):
    body = field(1, VARINT, protocol) + field(2, LEN, name) + field(3, VARINT, pid)
    body += field(4, VARINT, index)
    return field(1, LEN, body)


def tensor(name, offset, length):
    return field(1, LEN, name) + field(2, VARINT, offset) + field(3, VARINT, length)


def mem_shm(name, nbytes):
    return field(1, VARINT, 0) + field(2, LEN, name) + field(4, VARINT, nbytes)


def mem_ipc(handle, nbytes, offset=None, device=0, uuid=None):
    """A CUDA IPC MemHandle: the handle's bytes as given (forged in tests)."""
    body = field(1, VARINT, 1) + field(3, LEN, handle) + field(4, VARINT, nbytes)
    body += field(5, VARINT, device)
    if offset is not None:
        body += field(6, VARINT, offset)
    if uuid is not None:  # the GPU's UUID (16 bytes)
        body += field(7, LEN, uuid)
    return body


def register(tensors, params, grads, pdt=0, gdt=0, grad_event=None):
    body = b"".join(field(1, LEN, tensor(*t)) for t in tensors)
    body += field(2, VARINT, pdt) + field(3, VARINT, gdt)
    body += field(4, LEN, params) + field(5, LEN, grads)
    if grad_event is not None:  # an interprocess event handle (64 bytes)
        body += field(8, LEN, grad_event)
    return field(2, LEN, body)


def step(n, lr=0.01):
    return field(3, LEN, field(1, VARINT, n) + field(2, FIXED32, lr))


def post(n, first, count):
    """A Post (one-way: the daemon answers nothing)."""
    return field(11, LEN, field(1, VARINT, n) + field(2, VARINT, first) +
                 field(3, VARINT, count))


def sync():
    return field(8, LEN, b"")


def detach():
    return field(4, LEN, b"")


def status_request():
    return field(5, LEN, b"")


def shutdown():
    return field(7, LEN, b"")


def parse(buf):
    """Decode one message into {field: [values]}; LEN values stay bytes."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wtype = key >> 3, key & 7
        if wtype == VARINT:
            val, i = _read_varint(buf, i)
        elif wtype == FIXED64:
            val, i = struct.unpack_from("<d", buf, i)[0], i + 8
        elif wtype == FIXED32:
            val, i = struct.unpack_from("<f", buf, i)[0], i + 4
        elif wtype == LEN:
            ln, i = _read_varint(buf, i)
            val, i = bytes(buf[i:i + ln]), i + ln
        else:
            raise ValueError("wire type %d" % wtype)
        out.setdefault(num, []).append(val)
    return out


def _read_varint(buf, i):
    shift = val = 0
    while True:
        b = buf[i]
        i += 1
        val |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return val, i


def reply(buf):
    """(status, message or None, body fields) of a scape.Reply."""
    f = parse(buf)
    status = f.get(1, [0])[0]
    message = None
    if 2 in f:
        message = parse(f[2][0]).get(2, [b""])[0].decode()
    return status, message, f


def query_status(endpoint, timeout_ms=10000):
    """Ask a daemon's status socket (REQ/REP at endpoint): (reply status,
    message, the StatusReply's fields, its last StepDone's fields or {})."""
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        s.connect(endpoint)
        s.send(status_request())
        code, msg, f = reply(s.recv())
    finally:
        s.close()
        ctx.term()
    if code != 0 or 6 not in f:
        return code, msg, {}, {}
    st = parse(f[6][0])
    return code, msg, st, parse(st[14][0]) if 14 in st else {}
