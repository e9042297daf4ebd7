// router_client.mjs — load/consistency client of tests/integration/test_router*.sh (Node 20, no
// packages). Every mode prints one JSON object on stdout and exits 1 on an unexpected result.
//
//   node router_client.mjs prefix URL N CONC GROUPS SEED
//       N non-streaming completions (prompt as token ids) from CONC concurrent loops: GROUPS
//       groups, each prompt = its group's 96-token prefix + 8 random tokens. Reports the prefix-hit rate
//       the workers saw (usage.prompt_tokens_details.cached_tokens / prompt_tokens).
//   node router_client.mjs failover URL N MAX_TOKENS KILL_PID KILL_AFTER_CHUNKS [REF_URL]
//       N greedy streams (ignore_eos) at once; after KILL_AFTER_CHUNKS content chunks in total it
//       SIGKILLs KILL_PID. Every stream must end with [DONE], carry no error event and one id,
//       and its text must equal a fresh non-streaming greedy run of the same request (REF_URL,
//       default URL): no gap, no duplicate.
//   node router_client.mjs burst URL N BODY_JSON [HEADER=VALUE...]
//       N copies of a streaming request at once; reports statuses, latencies of the rejections
//       (ms until the status line) and TTFTs of the accepted ones.
//   node router_client.mjs qos URL SECONDS FREE_CONC PREMIUM_CONC BODY_JSON
//       FREE_CONC loops sending x-priority: free and PREMIUM_CONC loops sending premium for
//       SECONDS; reports per class: ok, rejected, TTFT p50/p95.
const [mode, base, ...rest] = process.argv.slice(2);
const fail = (m) => { console.error(`router_client: ${m}`); process.exit(1); };

function rng(seed) { let s = seed >>> 0; return () => (s = (s * 1664525 + 1013904223) >>> 0) / 4294967296; }

async function post(path, body, headers = {}) {
  return fetch(base + path, { method: 'POST', headers: { 'Content-Type': 'application/json', ...headers },
                              body: JSON.stringify(body) });
}

// Reads an SSE body: {text, ids:Set, done, errors, firstMs, chunks}
async function readStream(res, t0, onChunk) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = '', text = '', done = 0, errors = 0, firstMs = null, chunks = 0, usage = null;
  const ids = new Set();
  for (;;) {
    const { value, done: eof } = await reader.read();
    if (eof) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = ev.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6)).join('\n');
      if (!data) continue;
      if (data === '[DONE]') { done++; continue; }
      const j = JSON.parse(data);
      if (j.error) { errors++; continue; }
      if (j.usage) usage = j.usage;
      if (j.choices && j.choices.length === 0) continue;  // the usage chunk
      if (firstMs === null) firstMs = performance.now() - t0;
      ids.add(j.id);
      const c = j.choices && j.choices[0];
      const piece = c ? (c.text ?? (c.delta && c.delta.content) ?? '') : '';
      if (piece) { text += piece; chunks++; if (onChunk) onChunk(); }
    }
  }
  return { text, ids, done, errors, firstMs, chunks, usage };
}

const pct = (a, p) => { if (!a.length) return null; const s = [...a].sort((x, y) => x - y); return s[Math.min(s.length - 1, Math.floor(p * s.length))]; };

async function modePrefix(n, conc, nGroups, seed) {
  const r = rng(seed);
  const groups = Array.from({ length: nGroups }, () => Array.from({ length: 96 }, () => 10 + Math.floor(r() * 4000)));
  let next = 0, prompt = 0, cached = 0, ok = 0;
  async function loop() {
    while (next < n) {
      const k = next++;
      const ids = [...groups[Math.floor(r() * nGroups)], ...Array.from({ length: 8 }, () => 10 + Math.floor(r() * 4000))];
      const res = await post('/v1/completions', { prompt: ids, max_tokens: 4, temperature: 0 });
      const j = await res.json();
      if (res.status !== 200) fail(`prefix: status ${res.status}: ${JSON.stringify(j)}`);
      prompt += j.usage.prompt_tokens;
      cached += (j.usage.prompt_tokens_details || {}).cached_tokens || 0;
      ok++;
    }
  }
  await Promise.all(Array.from({ length: conc }, loop));
  console.log(JSON.stringify({ ok, prompt_tokens: prompt, cached_tokens: cached, hit_rate: cached / prompt }));
}

async function modeFailover(n, maxTokens, pid, killAfter, refUrl) {
  const r = rng(99);
  const reqs = Array.from({ length: n }, (_, k) => ({
    prompt: Array.from({ length: 20 + k }, () => 10 + Math.floor(r() * 4000)),
    max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true, stream_options: { include_usage: true } }));
  let total = 0, killed = false;
  const onChunk = () => { if (++total >= killAfter && !killed) { killed = true; process.kill(pid, 'SIGKILL'); } };
  const outs = await Promise.all(reqs.map(async (body) => {
    const t0 = performance.now();
    const res = await post('/v1/completions', body);
    if (res.status !== 200) fail(`failover: status ${res.status}: ${await res.text()}`);
    return readStream(res, t0, onChunk);
  }));
  if (!killed) fail('failover: the worker was never killed (streams too short?)');
  let bad = 0;
  for (let k = 0; k < n; k++) {
    const o = outs[k];
    const ref = await fetch((refUrl || base) + '/v1/completions', { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ ...reqs[k], stream: false, stream_options: undefined }) }).then((x) => x.json());
    const want = ref.choices[0].text;
    // usage after a failover must be the uninterrupted run's (issue 18: 214/211 instead of 125/300)
    const u = o.usage, w = ref.usage;
    const usageOk = u && u.prompt_tokens === w.prompt_tokens && u.completion_tokens === w.completion_tokens &&
                    u.total_tokens === w.total_tokens;
    if (o.done !== 1 || o.errors || o.ids.size !== 1 || o.text !== want || !usageOk) {
      bad++;
      console.error(`stream ${k}: done=${o.done} errors=${o.errors} ids=${o.ids.size} usage=${JSON.stringify(u)} want usage=${JSON.stringify(w)}\n got: ${JSON.stringify(o.text)}\nwant: ${JSON.stringify(want)}`);
    }
  }
  console.log(JSON.stringify({ n, bad, chunks: total }));
  if (bad) process.exit(1);
}

async function modeBurst(n, body, hdrs) {
  const headers = Object.fromEntries(hdrs.map((h) => h.split('=')));
  const res = await Promise.all(Array.from({ length: n }, async () => {
    const t0 = performance.now();
    const r = await post('/v1/completions', body, headers);
    const statusMs = performance.now() - t0;
    if (r.status !== 200) { await r.text(); return { status: r.status, ms: statusMs, retryAfter: r.headers.get('retry-after') }; }
    const o = await readStream(r, t0);
    if (o.done !== 1 || o.errors) fail('burst: broken accepted stream');
    return { status: 200, ttft: o.firstMs };
  }));
  const rej = res.filter((x) => x.status !== 200);
  const acc = res.filter((x) => x.status === 200);
  console.log(JSON.stringify({
    n, ok: acc.length, rejected: rej.length, statuses: [...new Set(res.map((x) => x.status))],
    reject_ms_max: rej.length ? Math.max(...rej.map((x) => x.ms)) : null,
    retry_after_all: rej.every((x) => x.retryAfter),
    ttft_ms_p50: pct(acc.map((x) => x.ttft), 0.5), ttft_ms_max: acc.length ? Math.max(...acc.map((x) => x.ttft)) : null }));
}

async function modeQos(seconds, freeConc, premConc, body) {
  const end = performance.now() + seconds * 1000;
  const stats = { free: { ok: 0, rejected: 0, ttft: [] }, premium: { ok: 0, rejected: 0, ttft: [] } };
  async function loop(cls) {
    while (performance.now() < end) {
      const t0 = performance.now();
      const r = await post('/v1/completions', body, { 'x-priority': cls });
      if (r.status !== 200) { await r.text(); stats[cls].rejected++; await new Promise((ok) => setTimeout(ok, 5)); continue; }
      const o = await readStream(r, t0);
      if (o.done !== 1 || o.errors) fail('qos: broken stream');
      stats[cls].ok++; stats[cls].ttft.push(o.firstMs);
    }
  }
  await Promise.all([...Array.from({ length: freeConc }, () => loop('free')),
                     ...Array.from({ length: premConc }, () => loop('premium'))]);
  const out = {};
  for (const c of ['free', 'premium']) out[c] = { ok: stats[c].ok, rejected: stats[c].rejected,
    ttft_ms_p50: pct(stats[c].ttft, 0.5), ttft_ms_p95: pct(stats[c].ttft, 0.95) };
  console.log(JSON.stringify(out));
}

if (mode === 'prefix') await modePrefix(+rest[0], +rest[1], +rest[2], +rest[3]);
else if (mode === 'failover') await modeFailover(+rest[0], +rest[1], +rest[2], +rest[3], rest[4]);
else if (mode === 'burst') await modeBurst(+rest[0], JSON.parse(rest[1]), rest.slice(2));
else if (mode === 'qos') await modeQos(+rest[0], +rest[1], +rest[2], JSON.parse(rest[3]));
else fail(`unknown mode ${mode}`);
