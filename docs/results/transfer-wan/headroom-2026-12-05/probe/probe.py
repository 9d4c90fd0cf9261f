import socket, sys, time, struct
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[2], 47001)); s.listen(1)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(8)
        if not b: break
        c.sendall(b)
else:
    c = socket.create_connection((sys.argv[2], 47001)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = open(sys.argv[3], "w"); end = time.time() + float(sys.argv[4])
    while time.time() < end:
        t = time.perf_counter(); c.sendall(b"x" * 8); c.recv(8)
        out.write(f"{(time.perf_counter() - t) * 1000:.3f}\n"); out.flush(); time.sleep(0.02)
