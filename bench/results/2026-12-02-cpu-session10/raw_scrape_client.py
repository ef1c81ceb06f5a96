import socket, sys, time, statistics
path = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
s = socket.socket(socket.AF_UNIX); s.connect(path)
def get(ep):
    s.sendall(f"GET /{ep} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf: buf += s.recv(65536)
    head, body = buf.split(b"\r\n\r\n", 1)
    cl = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < cl: body += s.recv(1 << 20)
    return body
for ep in ("health", "metrics"):
    xs = []
    for i in range(n):
        t = time.perf_counter(); get(ep); xs.append((time.perf_counter() - t) * 1e3)
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.01)
    xs.sort(); print(ep, "p50 %.2f p99 %.2f" % (xs[len(xs)//2], xs[int(len(xs)*0.99)]))
