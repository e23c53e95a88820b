// The peer's page: polls /v1/swarm and /v1/requests, streams completions for "Try it".
// Plain JavaScript, no dependencies. Everything from the network is shown with
// textContent (never parsed as HTML): peer ids, reasons and answers come from other peers.
'use strict';

const KEY_STORAGE = 'prefixswarm-api-key'; // sessionStorage: this tab only
const POLL_MIN_MS = 250; // polls come 4 times a summary interval, within these bounds
const POLL_MAX_MS = 2000;
const FETCH_TIMEOUT_MS = 5000;
const PRUNE_MS = 100;

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || '',
  selfId: '',
  pollMs: 1000,
  lastOk: null,
  expiryS: null, // a peer silent this long is gone (the server's rule, from /v1/requests)
  names: new Map(), // peer id -> short label
};

const $ = (id) => document.getElementById(id);

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function authHeaders() {
  return state.key ? { Authorization: 'Bearer ' + state.key } : {};
}

class NeedsKey extends Error {}

async function getJson(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const res = await fetch(path, { headers: authHeaders(), signal: ctl.signal, cache: 'no-store' });
    if (res.status === 401) throw new NeedsKey('this peer needs an API key');
    if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
    return await res.json();
  } finally {
    clearTimeout(timer);
  }
}

// -- formatting ------------------------------------------------------------------------

function short(id) {
  if (!id) return '-';
  return id.length > 10 ? '…' + id.slice(-8) : id;
}

function who(id) {
  if (!id) return '-';
  return id === state.selfId ? short(id) + ' (this peer)' : short(id);
}

function num(v, digits) {
  return typeof v === 'number' && isFinite(v) ? v.toFixed(digits) : '-';
}

function pct(v) {
  return typeof v === 'number' && isFinite(v) ? (100 * v).toFixed(1) + '%' : '-';
}

function secs(v) {
  if (typeof v !== 'number' || !isFinite(v)) return '-';
  return v < 1 ? (1000 * v).toFixed(0) + ' ms' : v.toFixed(2) + ' s';
}

function addrOf(p) {
  const addrs = p.addrs || [];
  if (!addrs.length) return '-';
  return addrs[0].replace(/\/p2p\/[^/]+$/, '') + (addrs.length > 1 ? ` (+${addrs.length - 1})` : '');
}

// Direct or relayed: the `link` the peer reports ('direct', 'relayed' or null: not
// connected now) when it does, else a /p2p-circuit address says relayed.
function pathOf(p) {
  if (p.isSelf) return p.reachability ? 'reachability: ' + describe(p.reachability) : '-';
  if ('link' in p) return p.link || 'not connected';
  if (typeof p.relayed === 'boolean') return p.relayed ? 'relayed' : 'direct';
  const addrs = p.addrs || [];
  if (!addrs.length) return '-';
  return addrs.every((a) => a.includes('/p2p-circuit')) ? 'relayed' : 'direct';
}

function describe(v) {
  if (v === undefined || v === null || v === '') return '-';
  if (typeof v === 'boolean') return v ? 'yes' : 'no';
  if (typeof v !== 'object') return String(v);
  const head = v.state ?? v.status ?? v.reachability ?? v.kind;
  const rest = Object.entries(v)
    .filter(([k, x]) => !['state', 'status', 'reachability', 'kind'].includes(k) && x !== null
      && typeof x !== 'object')
    .map(([k, x]) => `${k.replace(/_/g, ' ')}: ${x}`);
  return [head, ...rest].filter((x) => x !== undefined && x !== '').join('; ') || '-';
}

// The trust ledger's view of a peer: {state, reason, verified, served, discount, claims}.
function trustOf(p) {
  const t = p.trust;
  if (t === undefined || t === null) return { text: '-', state: '', title: '' };
  if (typeof t !== 'object') return { text: String(t), state: String(t), title: '' };
  const words = [String(t.state ?? '-')];
  if (t.claims && t.claims !== 'believed') words.push(`claims ${t.claims}`);
  if (typeof t.verified === 'number') words.push(`${t.verified} verified`);
  let text = words.join(', ');
  if (t.reason) text += ': ' + t.reason;
  return { text, state: String(t.state || ''), title: describe(t) };
}

function reachOf(self) {
  for (const key of ['reachability', 'reachable', 'nat', 'relayed']) {
    if (key in self) return (key === 'relayed' ? 'relayed: ' : '') + describe(self[key]);
  }
  return '-';
}

// -- the swarm table -------------------------------------------------------------------

function swarmRows(swarm) {
  const s = swarm.self;
  const self = {
    peer_id: s.peer_id, addrs: s.addrs, rtt_s: null, running_requests: s.running_requests,
    queued_prompt_tokens: s.queued_prompt_tokens, prefill_tokens_per_s: s.prefill_tokens_per_s,
    decode_tokens_per_s: s.decode_tokens_per_s, cached_blocks: s.cached_blocks,
    capacity_blocks: s.capacity_blocks, summary_age_s: null, isSelf: true,
    relayed: s.relayed, reachability: s.reachability, software: s.software,
  };
  return [self, ...swarm.peers];
}

function swarmCells(p) {
  const trust = p.isSelf ? { text: 'this peer', state: 'self' } : trustOf(p);
  const load = `${p.running_requests ?? '-'} running, ${p.queued_prompt_tokens ?? '-'} queued tok`;
  const speed = `${num(p.prefill_tokens_per_s, 0)} prefill / ${num(p.decode_tokens_per_s, 0)} decode`;
  return [
    who(p.peer_id),
    addrOf(p),
    pathOf(p),
    p.isSelf ? '-' : p.rtt_s === null || p.rtt_s === undefined ? '-' : num(1000 * p.rtt_s, 1) + ' ms',
    load,
    speed,
    `${p.cached_blocks ?? '-'} / ${p.capacity_blocks ?? '-'}`,
    p.isSelf ? 'live' : num(p.summary_age_s, 1) + ' s',
    trust.text,
    (p.software || 'unknown') + (p.older_software ? ' (older)' : ''),
  ];
}

const NUMERIC = new Set([3, 6, 7]);

function renderSwarm(swarm) {
  const body = $('swarm-table').tBodies[0];
  const rows = swarmRows(swarm);
  const seen = new Set();
  let before = body.firstElementChild;
  for (const p of rows) {
    seen.add(p.peer_id);
    let tr = body.querySelector(`tr[data-peer="${CSS.escape(p.peer_id)}"]`);
    if (!tr) {
      tr = el('tr', null, { 'data-peer': p.peer_id });
      swarmCells(p).forEach((_, i) => tr.appendChild(el(i === 0 ? 'th' : 'td', '', i === 0
        ? { scope: 'row' } : NUMERIC.has(i) ? { class: 'num' } : {})));
    }
    swarmCells(p).forEach((text, i) => {
      const cell = tr.children[i];
      if (cell.textContent !== text) cell.textContent = text;
    });
    tr.cells[0].title = p.peer_id;
    if (!p.isSelf && typeof p.summary_age_s === 'number') {
      tr.dataset.summaryAt = String(performance.now() / 1000 - p.summary_age_s);
    }
    tr.cells[1].title = (p.addrs || []).join('\n');
    tr.cells[8].title = p.isSelf ? '' : trustOf(p).title;
    const trust = p.isSelf ? 'self' : trustOf(p).state;
    tr.cells[9].title = p.older_software ? 'older software than this peer: it may lack fixes' : '';
    tr.className = [p.isSelf ? 'self' : '', trust ? 'trust-' + trust : '',
      p.older_software ? 'older' : ''].join(' ').trim();
    if (tr !== before) body.insertBefore(tr, before);
    before = tr.nextElementSibling;
  }
  for (const tr of [...body.rows]) if (!seen.has(tr.dataset.peer)) tr.remove();
  $('swarm-count').textContent = `(${rows.length} peer${rows.length === 1 ? '' : 's'})`;
}

// Between polls, drop a row the moment its peer passes the expiry the server applies: its
// last summary's age then exceeds it (the next poll would not list it).
function pruneSilent() {
  if (!state.expiryS) return;
  const now = performance.now() / 1000;
  for (const tr of [...$('swarm-table').tBodies[0].rows]) {
    const since = parseFloat(tr.dataset.summaryAt);
    if (isFinite(since) && now - since > state.expiryS) tr.remove();
  }
}

// -- this peer -------------------------------------------------------------------------

function renderSelf(swarm, activity) {
  const s = swarm.self;
  const r = activity.requests;
  const e = activity.engine;
  const fill = s.capacity_blocks ? s.cached_blocks / s.capacity_blocks : null;
  const outcomes = Object.entries(r.by_outcome || {}).filter(([k, v]) => k !== 'ok' && v > 0)
    .map(([k, v]) => `${v} ${k}`).join(', ');
  const facts = [
    ['Peer id', s.peer_id],
    ['Model', `${s.model} (blocks of ${s.block_size} tokens, policy ${s.policy})`],
    ['Cache fill', `${s.cached_blocks} / ${s.capacity_blocks} blocks (${pct(fill)})`],
    ['Prefix hit ratio', e.hit_ratio === null ? '- (no prompt served yet)'
      : `${pct(e.hit_ratio)} (${e.cached_tokens} of ${e.prompt_tokens} prompt tokens from cache)`],
    ['Requests entered here', `${r.entered}` + (outcomes ? ` (${outcomes})` : '')],
    ['Served here / forwarded', `${r.served_here} / ${r.forwarded}`],
    ['Served for other peers', `${r.served_for_others}`],
    ['Reachability', reachOf(s)],
  ];
  const dl = $('self-facts');
  dl.replaceChildren(...facts.flatMap(([k, v]) => [el('dt', k), el('dd', v)]));
  $('title-peer').textContent = short(s.peer_id);
  drawChart(activity.history || []);
}

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// history: oldest first, {age_s, hit_ratio, window_hit_ratio, fill} (ratios 0..1 or null).
function drawChart(history) {
  const W = 320, H = 120, L = 34, R = 6, T = 6, B = 16;
  const parts = [];
  const y = (v) => T + (1 - Math.min(1, Math.max(0, v))) * (H - T - B);
  for (const v of [0, 0.5, 1]) {
    parts.push(svg('line', { x1: L, x2: W - R, y1: y(v), y2: y(v), class: 'grid' }));
    const label = svg('text', { x: L - 4, y: y(v) + 3, 'text-anchor': 'end', class: 'axis' });
    label.textContent = `${v * 100}%`;
    parts.push(label);
  }
  const span = Math.max(60, ...history.map((s) => s.age_s));
  const x = (age) => L + (1 - age / span) * (W - L - R);
  const axis = svg('text', { x: L, y: H - 3, class: 'axis' });
  axis.textContent = `last ${Math.round(span)} s`;
  parts.push(axis);
  const now = svg('text', { x: W - R, y: H - 3, 'text-anchor': 'end', class: 'axis' });
  now.textContent = 'now';
  parts.push(now);
  for (const [key, cls] of [['fill', 'line-fill'], ['hit_ratio', 'line-hit']]) {
    const pts = history.filter((s) => typeof s[key] === 'number')
      .map((s) => `${x(s.age_s).toFixed(1)},${y(s[key]).toFixed(1)}`);
    if (pts.length) parts.push(svg('polyline', { points: pts.join(' '), class: cls }));
  }
  for (const s of history) {
    if (typeof s.window_hit_ratio !== 'number') continue;
    parts.push(svg('circle', { cx: x(s.age_s).toFixed(1), cy: y(s.window_hit_ratio).toFixed(1),
      r: 2.5, class: 'dot-hit' }));
  }
  $('chart').replaceChildren(...parts);
}

// -- recent requests -------------------------------------------------------------------

function routeList(route) {
  const ol = el('ol', null, { class: 'route' });
  if (!route.length) ol.appendChild(el('li', 'no candidate tried'));
  for (const step of route) {
    const li = el('li');
    const words = [who(step.peer_id) + (step.local ? ' (local)' : ''), step.outcome];
    if (step.tokens) words.push(`${step.tokens} tok`);
    if (step.detail) words.push(step.detail);
    li.appendChild(el('span', words.join(' — ')));
    if (step.reason) {
      const d = el('details');
      d.appendChild(el('summary', 'why chosen'));
      d.appendChild(el('p', step.reason));
      li.appendChild(d);
    }
    ol.appendChild(li);
  }
  return ol;
}

function renderRequests(recent) {
  const body = $('req-table').tBodies[0];
  const seen = new Set();
  let before = body.firstElementChild;
  for (const r of recent) {
    seen.add(r.request_id);
    let tr = body.querySelector(`tr[data-request="${CSS.escape(r.request_id)}"]`);
    if (!tr) {
      tr = el('tr', null, { 'data-request': r.request_id, class: 'outcome-' + r.outcome });
      tr.appendChild(el('td', '', { class: 'num age' }));
      const outcome = el('td', r.outcome.toUpperCase() === 'OK' ? 'ok' : r.outcome.toUpperCase());
      if (r.error) outcome.appendChild(el('div', r.error, { class: 'error' }));
      tr.appendChild(outcome);
      tr.appendChild(el('td', who(r.served_by), { title: r.served_by || '' }));
      tr.appendChild(el('td', `${r.cached_tokens} / ${r.prompt_tokens}`, { class: 'num' }));
      tr.appendChild(el('td', secs(r.ttft_s), { class: 'num' }));
      tr.appendChild(el('td', secs(r.total_s), { class: 'num' }));
      const route = el('td');
      route.appendChild(routeList(r.route));
      tr.appendChild(route);
    }
    tr.cells[0].textContent = `${num(r.age_s, 0)} s ago`;
    if (tr !== before) body.insertBefore(tr, before);
    before = tr.nextElementSibling;
  }
  for (const tr of [...body.rows]) if (!seen.has(tr.dataset.request)) tr.remove();
  if (!recent.length && !body.rows.length) {
    const tr = el('tr', null, { 'data-request': '' });
    tr.appendChild(el('td', 'No request has entered here yet.', { colspan: '7' }));
    body.appendChild(tr);
  }
}

// -- the invite ------------------------------------------------------------------------

function renderInvite(invite) {
  const command = invite ? 'prefixswarm serve --join ' + invite : null;
  $('invite').textContent = command ?? 'no dialable address to invite others with yet';
  $('copy-invite').disabled = !command;
  $('copy-invite').dataset.command = command ?? '';
}

async function copyInvite() {
  const command = $('copy-invite').dataset.command;
  try {
    await navigator.clipboard.writeText(command);
    $('invite-note').textContent = 'copied';
  } catch {  // no clipboard (plain http on another host): select it for Ctrl-C
    getSelection().selectAllChildren($('invite'));
    $('invite-note').textContent = 'selected: press Ctrl-C';
  }
}

// -- polling ---------------------------------------------------------------------------

function showKeyForm(message) {
  $('key-form').hidden = false;
  $('status').textContent = message;
}

async function poll() {
  try {
    const [swarm, activity] = await Promise.all([getJson('/v1/swarm'), getJson('/v1/requests')]);
    state.selfId = swarm.self.peer_id;
    const interval = 1000 * (activity.summary_interval_s || 1);
    state.pollMs = Math.min(POLL_MAX_MS, Math.max(POLL_MIN_MS, interval / 4));
    state.expiryS = activity.summary_expiry_s || null;
    renderSwarm(swarm);
    renderInvite(swarm.invite);
    renderSelf(swarm, activity);
    renderRequests(activity.recent);
    state.lastOk = new Date();
    $('status').textContent = `Live: updated ${state.lastOk.toLocaleTimeString()}, `
      + `${swarm.peers.length + 1} peers known.`;
    $('key-form').hidden = true;
  } catch (err) {
    if (err instanceof NeedsKey) {
      showKeyForm(state.key ? 'That API key was refused; enter another.' : 'This peer needs an API key.');
    } else {
      const since = state.lastOk ? ` (last update ${state.lastOk.toLocaleTimeString()})` : '';
      $('status').textContent = `Cannot reach this peer: ${err.message || err}${since}. Retrying.`;
    }
  } finally {
    setTimeout(poll, state.pollMs);
  }
}

// -- try it ----------------------------------------------------------------------------

let running = null; // the AbortController of the completion in progress

function setMeta(fields) {
  const dl = el('dl', null, { class: 'meta' });
  for (const [key, label, value] of fields) {
    dl.appendChild(el('dt', label));
    dl.appendChild(el('dd', value, { 'data-field': key }));
  }
  $('answer-meta').replaceChildren(dl);
}

async function complete(event) {
  event.preventDefault();
  if (running) return;
  const chat = $('endpoint').value === 'chat';
  const prompt = $('prompt').value;
  const maxTokens = Math.max(1, parseInt($('max-tokens').value, 10) || 32);
  const body = { max_tokens: maxTokens, stream: true, stream_options: { include_usage: true } };
  if (chat) body.messages = [{ role: 'user', content: prompt }];
  else body.prompt = prompt;
  running = new AbortController();
  $('send').disabled = true;
  $('stop').disabled = false;
  const answer = $('answer');
  answer.textContent = '';
  setMeta([['state', 'State', 'waiting for the first token…']]);
  const t0 = performance.now();
  let firstMs = null, ext = null, usage = null, servedBy = '', error = '';
  try {
    const res = await fetch(chat ? '/v1/chat/completions' : '/v1/completions', {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...authHeaders() },
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!res.ok) {
      const data = await res.json().catch(() => null);
      if (res.status === 401) showKeyForm('This peer needs an API key.');
      throw new Error(`HTTP ${res.status}: ${data?.error?.message || res.statusText}`);
    }
    servedBy = res.headers.get('x-prefixswarm-served-by') || '';
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const eventText = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = eventText.split('\n').filter((l) => l.startsWith('data:'))
          .map((l) => l.slice(5).trim()).join('\n');
        if (!data || data === '[DONE]') continue;
        const obj = JSON.parse(data);
        if (obj.error) { error = obj.error.message; continue; }
        const choice = (obj.choices || [])[0];
        const text = choice ? (chat ? choice.delta?.content : choice.text) : '';
        if (text) {
          if (firstMs === null) firstMs = performance.now() - t0;
          answer.textContent += text;
        }
        if (obj.x_prefixswarm) ext = obj.x_prefixswarm;
        if (obj.usage) usage = obj.usage;
      }
    }
  } catch (err) {
    error = err.name === 'AbortError' ? 'stopped' : String(err.message || err);
  } finally {
    running = null;
    $('send').disabled = false;
    $('stop').disabled = true;
  }
  const served = ext?.served_by || servedBy;
  const fields = [
    ['state', 'State', error ? 'error: ' + error : 'done'],
    ['served-by', 'Served by', served ? who(served) : '-'],
    ['cached', 'Cached tokens', usage ? String(usage.prompt_tokens_details?.cached_tokens ?? 0) : '-'],
    ['prompt', 'Prompt tokens', usage ? String(usage.prompt_tokens) : '-'],
    ['completion', 'Completion tokens', usage ? String(usage.completion_tokens) : '-'],
    ['ttft', 'Time to first token', ext ? secs(ext.ttft_s) + ' at the entry peer'
      : firstMs === null ? '-' : secs(firstMs / 1000) + ' in this browser'],
    ['route', 'Route', ext ? ext.route.map((a) => `${who(a.peer_id)} ${a.outcome}`).join(' → ') : '-'],
  ];
  setMeta(fields);
  if (served) $('answer-meta').dataset.servedBy = served;
}

function init() {
  $('try-form').addEventListener('submit', complete);
  $('stop').addEventListener('click', () => running && running.abort());
  $('copy-invite').addEventListener('click', copyInvite);
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) $('try-form').requestSubmit();
  });
  $('key-form').addEventListener('submit', (e) => {
    e.preventDefault();
    state.key = $('key-input').value.trim();
    $('key-input').value = '';
    if (state.key) sessionStorage.setItem(KEY_STORAGE, state.key);
    else sessionStorage.removeItem(KEY_STORAGE);
    $('key-form').hidden = true;
    $('status').textContent = 'Trying the key…';
  });
  drawChart([]);
  poll();
  setInterval(pruneSilent, PRUNE_MS);
}

document.addEventListener('DOMContentLoaded', init);
