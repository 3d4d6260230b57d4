# SPDX-License-Identifier: Apache-2.0
"""prometheus_scrape: a real Prometheus server scrapes every service of `tandem up`.

Starts `tandem up --prefill 1 --decode 1`, sends a few disaggregated requests,
writes a Prometheus config scraping the router, the decode and the prefill
worker every second (with the component/role/pod labels of
deploy/observability/prometheus-local.yml), starts Debian's `prometheus` on a
free port with its own storage folder, and queries its HTTP API
(/api/v1/query) until every target is up and each role's metrics are there
with the right labels and values: vllm:num_requests_running,
vllm:kv_cache_usage_perc and vllm:cache_config_info from decode,
tandem:pd_prefill_requests_total and tandem:kv_transfer_bytes_total from
prefill, tandem:router_requests_total, tandem:router_pd_decision_total and
tandem:router_ready_endpoints from the router. Skips (exit 77) when the
prometheus binary is absent.
"""
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

from stack_harness import (_PROCS, Stack, check, fail, free_port, make_model, parse_args, post,
                           skip)

MODEL = "tandem-prom-test"


def query(prom_port, promql):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (prom_port,
                                                    urllib.parse.urlencode({"query": promql}))
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    check(body.get("status") == "success", "query %s: %s" % (promql, body))
    return body["data"]["result"]


def wait_query(prom_port, promql, pred, what, timeout=40.0):
    """Re-runs promql until pred(result) holds; returns the result."""
    end = time.time() + timeout
    res = None
    while time.time() < end:
        res = query(prom_port, promql)
        if pred(res):
            return res
        time.sleep(0.5)
    fail("%s: %s gave %s" % (what, promql, json.dumps(res)[:2000]))


def main():
    args = parse_args()
    prom = shutil.which(args.prometheus)
    if not prom:
        skip("prometheus not found (Debian: apt-get install prometheus)")
    model = make_model(args)
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "1", "--pd-mode", "always",
               "--served-model-name", MODEL)
    for i in range(3):
        s, _, body = post(st.port(), "/v1/completions",
                          {"model": MODEL, "prompt": "Scrape me %d" % i, "max_tokens": 8,
                           "ignore_eos": True})
        check(s == 200, "request %d: %d %s" % (i, s, body))

    # The scrape config: one job, a target per process, labelled like the
    # local observability config (component, role, pod).
    pdir = os.path.join(args.workdir, "prometheus")
    shutil.rmtree(pdir, ignore_errors=True)
    os.makedirs(pdir)
    targets = []
    for name, ep in sorted(st.endpoints.items()):
        comp = name.split("-")[0]
        labels = {"component": comp, "pod": name if comp != "router" else "router-0"}
        if comp != "router":
            labels["role"] = comp
        targets.append("      - targets: ['127.0.0.1:%d']\n        labels: %s\n"
                       % (ep["port"], json.dumps(labels)))
    cfg = os.path.join(pdir, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                "  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: tandem\n    static_configs:\n" + "".join(targets))
    prom_port = free_port()
    plog = open(os.path.join(pdir, "prometheus.log"), "w")
    p = subprocess.Popen([prom, "--config.file=" + cfg,
                          "--storage.tsdb.path=" + os.path.join(pdir, "data"),
                          "--web.listen-address=127.0.0.1:%d" % prom_port, "--log.level=warn"],
                         stdout=plog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    _PROCS.append(p)
    end = time.time() + 30
    while True:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % prom_port, timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if p.poll() is not None or time.time() > end:
            with open(os.path.join(pdir, "prometheus.log")) as f:
                fail("prometheus did not become ready:\n" + f.read()[-3000:])
        time.sleep(0.2)

    # Every target scraped and up.
    up = wait_query(prom_port, "up", lambda r: len(r) == 3 and all(x["value"][1] == "1" for x in r),
                    "all three targets up")
    comps = sorted(x["metric"]["component"] for x in up)
    check(comps == ["decode", "prefill", "router"], "up components: %s" % comps)

    def one_series(promql, what, labels):
        res = wait_query(prom_port, promql, lambda r: len(r) >= 1, what)
        m = res[0]["metric"]
        for k, v in labels.items():
            check(m.get(k) == v, "%s: label %s=%r, expected %r (%s)" % (what, k, m.get(k), v, m))
        return res

    d = st.endpoints["decode-0"]["port"]
    pf = st.endpoints["prefill-0"]["port"]
    rt = st.endpoints["router"]["port"]
    # decode: vLLM's gauges with vLLM's labels plus the scrape's.
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:num_requests_waiting"):
        res = one_series('%s{component="decode"}' % name, "decode " + name,
                         {"__name__": name, "model_name": MODEL, "engine": "0", "job": "tandem",
                          "instance": "127.0.0.1:%d" % d, "pod": "decode-0", "role": "decode"})
        check(len(res) == 1 and res[0]["value"][1] == "0", "%s idle: %s" % (name, res))
    one_series('vllm:cache_config_info{component="decode"}', "decode cache_config_info",
               {"block_size": "16", "engine": "0", "pod": "decode-0"})
    res = one_series('sum(vllm:generation_tokens_total{component="decode"})',
                     "decode generation tokens", {})
    check(float(res[0]["value"][1]) >= 24, "decode generation tokens: %s" % res)
    # prefill: the P/D counters.
    res = one_series('tandem:pd_prefill_requests_total{component="prefill"}', "prefill requests",
                     {"instance": "127.0.0.1:%d" % pf, "pod": "prefill-0", "role": "prefill"})
    check(float(res[0]["value"][1]) >= 3, "prefill requests: %s" % res)
    res = one_series('tandem:kv_transfer_bytes_total{component="prefill"}', "kv bytes", {})
    check(float(res[0]["value"][1]) > 0, "kv transfer bytes: %s" % res)
    # router: requests by status, P/D decisions, ready endpoints by role.
    res = one_series('tandem:router_requests_total{component="router",status="success"}',
                     "router requests", {"instance": "127.0.0.1:%d" % rt, "pod": "router-0"})
    check(float(res[0]["value"][1]) >= 3, "router successes: %s" % res)
    res = one_series('tandem:router_pd_decision_total{decision_type="prefill-decode"}',
                     "router P/D decisions", {"component": "router"})
    check(float(res[0]["value"][1]) >= 3, "router P/D decisions: %s" % res)
    res = wait_query(prom_port, 'tandem:router_ready_endpoints{component="router"}',
                     lambda r: len(r) == 2, "router ready endpoints")
    check(sorted((x["metric"]["role"], x["value"][1]) for x in res) ==
          [("decode", "1"), ("prefill", "1")], "router ready endpoints: %s" % res)
    # An aggregation across roles, as a dashboard would write it.
    res = wait_query(prom_port, "count by (component) ({job=\"tandem\"})",
                     lambda r: len(r) == 3, "series per component")
    print("prometheus sees %s" % {x["metric"]["component"]: x["value"][1] for x in res})

    p.terminate()
    p.wait(timeout=30)
    rc = st.stop()
    check(rc == 0, "tandem up exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()
    print("PASS")


if __name__ == "__main__":
    main()
