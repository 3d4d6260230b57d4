# SPDX-License-Identifier: Apache-2.0
"""Every bad-input class gets its documented error while a stream carries on.

A long stream runs throughout; meanwhile each bad request must come back with
its status and vLLM's nested body {"error":{"message","type","param","code"}}:
bad JSON, wrong types, out-of-range values, empty prompt, token ids outside the
vocabulary, prompt + max_tokens beyond the context -> 400; unknown model -> 404;
body over the size limit -> 413; unknown path -> 404; wrong method -> 405. The
stream must finish exactly as asked (finish_reason length, full usage). Then a
server with --api-key: /v1 routes need the Bearer key (401), /health and
/metrics stay open.
"""
import json
import socket
import threading

import decode_harness as h


def expect_error(srv, path, body, status, param_or_none=None, text=None, raw=False):
    st, hdrs, data = srv.request("POST", path, body if raw else json.dumps(body))
    h.check(st == status, "%s %r: status %d, expected %d (%r)" % (path, str(body)[:80], st, status,
                                                                  data[:200]))
    try:
        j = json.loads(data)
    except ValueError:
        h.fail("%s: error body is not JSON: %r" % (path, data[:200]))
    e = j.get("error")
    h.check(isinstance(e, dict) and set(e) >= {"message", "type", "param", "code"},
            "error body shape %r" % j)
    h.check(e["code"] == status, "code %r != %d" % (e["code"], status))
    h.check(isinstance(e["message"], str) and e["message"], "empty message")
    if param_or_none is not None:
        h.check(e["param"] == param_or_none, "param %r, expected %r" % (e["param"], param_or_none))
    if text is not None:
        h.check(text in e["message"], "message %r lacks %r" % (e["message"], text))
    return e


def oversized_body(srv, limit):
    # Headers announce more than the limit; the server answers 413 without
    # reading the body (the client sends only the first bytes).
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    try:
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Content-Length: %d\r\n\r\n" % (limit + 1)).encode() + b'{"prompt": "')
        resp = b""
        while b"\r\n\r\n" not in resp:
            chunk = s.recv(4096)
            if not chunk:
                break
            resp += chunk
        status = int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/1.") else -1
        h.check(status == 413, "oversized body: %r" % resp[:200])
    finally:
        s.close()
    # A body over the limit without a Content-Length (chunked) is cut off too.
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        sent = 0
        try:
            while sent <= limit + len(piece):
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                sent += len(piece)
        except OSError:
            pass  # the server may close once it has answered
        resp = s.recv(4096)
        h.check(resp.startswith(b"HTTP/1.1 413"), "chunked oversized body: %r" % resp[:100])
    finally:
        s.close()


def main():
    args = h.parse_args()
    model = h.make_model(args, "tiny-long", ["--max-pos", "32768"])
    limit = 1 << 20
    srv = h.Server(args, model, "--max-body-bytes", str(limit), "--max-model-len", "8192")

    # The concurrent stream that must not be disturbed.
    result = {}

    def stream():
        st = h.Stream(srv, "/v1/completions", {
            "prompt": "Keep talking.", "max_tokens": 6000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}})
        result["status"] = st.status
        n = 0
        for ev in st.events():
            n += 1
            if ev == "[DONE]":
                result["done"] = True
            elif ev["choices"]:
                result["finish"] = ev["choices"][0]["finish_reason"] or result.get("finish")
            else:
                result["usage"] = ev["usage"]
        result["events"] = n
        st.close()

    t = threading.Thread(target=stream)
    t.start()

    p = "/v1/completions"
    expect_error(srv, p, b"{not json", 400, raw=True)
    expect_error(srv, p, b"", 400, raw=True)
    expect_error(srv, p, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens")
    expect_error(srv, p, {"prompt": {"a": 1}}, 400, "prompt")
    expect_error(srv, p, {"prompt": "hi", "stream": "yes"}, 400, "stream")
    expect_error(srv, p, {"model": "nope", "prompt": "hi"}, 404, text="nope")
    expect_error(srv, p, {"prompt": "hi", "temperature": 3}, 400, "temperature")
    expect_error(srv, p, {"prompt": "hi", "top_p": 0}, 400, "top_p")
    expect_error(srv, p, {"prompt": "hi", "n": 0}, 400, "n")
    expect_error(srv, p, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens")
    expect_error(srv, p, {"prompt": ""}, 400, text="empty")
    expect_error(srv, p, {"prompt": []}, 400)
    expect_error(srv, p, {"prompt": [1, 2, 512]}, 400, "prompt", text="512")
    expect_error(srv, p, {"prompt": [1, -3]}, 400, "prompt")
    expect_error(srv, p, {"prompt": [5] * 9000, "max_tokens": 1}, 400,
                 text="maximum context length")
    expect_error(srv, p, {"prompt": "hi", "max_tokens": 9000}, 400,
                 text="maximum context length is 8192 tokens")
    expect_error(srv, "/v1/chat/completions", {"messages": "hello"}, 400, "messages")
    expect_error(srv, "/v1/chat/completions", {"messages": [{"role": "user"}],
                                               "max_tokens": 1}, 400)
    expect_error(srv, "/tokenize", {"prompt": 7}, 400)
    expect_error(srv, "/detokenize", {"tokens": [600]}, 400)
    oversized_body(srv, limit)
    st, _, data = srv.request("GET", "/v1/nothing-here")
    h.check(st == 404 and b'"error"' in data, "unknown path: %d %r" % (st, data[:100]))
    st, _, data = srv.request("GET", "/v1/completions")
    h.check(st == 405 and b'"error"' in data, "wrong method: %d %r" % (st, data[:100]))
    # A good request still works meanwhile.
    st, _, ok = srv.post_json(p, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    h.check(st == 200 and ok["usage"]["completion_tokens"] == 3, "good request: %d %r" % (st, ok))

    t.join(120)
    h.check(result.get("status") == 200 and result.get("done"), "stream: %r" % result)
    h.check(result.get("finish") == "length", "stream finish %r" % result.get("finish"))
    h.check(result.get("usage", {}).get("completion_tokens") == 6000,
            "stream usage %r" % result.get("usage"))
    h.check(srv.stop() == 0, "exit status")

    # The API key.
    srv = h.Server(args, model, "--api-key", "sesame")
    st, _, data = srv.request("GET", "/v1/models")
    h.check(st == 401, "no key: %d" % st)
    st, _, data = srv.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    h.check(st == 401, "wrong key: %d" % st)
    st, _, data = srv.request("POST", "/v1/completions", json.dumps({"prompt": "hi"}))
    h.check(st == 401 and json.loads(data)["error"]["code"] == 401, "no key POST: %d" % st)
    st, _, data = srv.request("GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
    h.check(st == 200 and json.loads(data)["data"][0]["id"] == "tiny-long", "key: %d %r" % (st, data))
    for path in ("/health", "/metrics", "/version"):
        st, _, _ = srv.request("GET", path)
        h.check(st == 200, "%s with --api-key: %d" % (path, st))
    h.check(srv.stop() == 0, "exit status")
    print("PASS: every bad-input class answered while a %d-event stream finished" %
          result["events"])


if __name__ == "__main__":
    main()
