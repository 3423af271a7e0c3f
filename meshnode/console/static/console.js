// The mesh console: polls /meshnode/mesh (meshnode/console/mesh_view.py) and draws it; streams a
// completion from /v1/completions. Plain DOM, no framework: the node serves this file as it is.
// Every string from the mesh (model names, versions) is set as text, never as HTML: gossip is
// written by other nodes.
"use strict";

const POLL_MS = 1000;
const KEY_STORAGE = "meshnode.apiKey";
let previous = null; // the last view, for tokens/s between two polls
let servedModel = null;

function $(id) {
  return document.getElementById(id);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "style") node.style.cssText = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : String(child));
    }
  }
  return node;
}

function authHeaders() {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

// A stable colour per node, so a node's segments and its row match.
function nodeColour(shortId) {
  let hash = 0;
  for (const ch of shortId) hash = (hash * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${hash % 360} 60% 55%)`;
}

function mib(bytes) {
  return (bytes / 1048576).toFixed(1);
}

function drawModels(view) {
  const box = $("models");
  box.replaceChildren();
  if (view.models.length === 0) {
    box.append(el("p", { class: "muted" }, "No model is served yet."));
    return;
  }
  for (const model of view.models) {
    const bar = el("div", { class: "coverage" });
    for (const segment of model.segments) {
      const width = (100 * (segment.end_layer - segment.start_layer)) / model.total_layers;
      const cell = el("div", {
        class: "segment" + (segment.nodes.length ? "" : " gap"),
        style: `width:${width}%`,
        "data-start": segment.start_layer,
        "data-end": segment.end_layer,
        "data-nodes": segment.nodes.join(" "),
        title: `layers [${segment.start_layer}, ${segment.end_layer}): ` +
          (segment.nodes.length ? segment.nodes.join(", ") : "nobody"),
      });
      for (const shortId of segment.nodes) {
        cell.append(el("span", { class: "server", style: `background:${nodeColour(shortId)}` }, shortId));
      }
      if (!segment.nodes.length) cell.append(el("span", { class: "server" }, "gap"));
      bar.append(cell);
    }
    const state = model.complete
      ? `complete, ${model.min_replicas} replica${model.min_replicas === 1 ? "" : "s"} of the thinnest layer`
      : "incomplete: no route";
    box.append(
      el(
        "div",
        { class: "model", "data-model": model.name, "data-complete": model.complete },
        el("div", { class: "model-title" }, el("strong", {}, model.name), " ",
          el("span", { class: "coverage-text" }, `${model.covered_layers}/${model.total_layers} layers covered`),
          " ", el("span", { class: model.complete ? "ok" : "bad" }, state)),
        bar,
      ),
    );
  }
}

function drawNodes(view) {
  const body = $("nodes").querySelector("tbody");
  body.replaceChildren();
  for (const node of view.nodes) {
    const serves = node.serving
      ? `${node.serving.model} [${node.serving.start_layer}, ${node.serving.end_layer})`
      : "nothing";
    const how = node.link.kind === "direct" && node.link.path && node.link.path !== "public" ? ` (${node.link.path})` : "";
    const link = node.link.kind === "self" ? "—" : node.link.kind + how;
    const sessions = node.load.max_sessions
      ? `${node.load.active_sessions}/${node.load.max_sessions}`
      : String(node.load.active_sessions);
    const row = el(
      "tr",
      { class: "node" + (node.self ? " self" : ""), "data-node-id": node.id, "data-link": node.link.kind },
      el("td", {}, el("span", { class: "dot", style: `background:${nodeColour(node.short_id)}` }),
        el("code", { title: node.id }, node.short_id)),
      el("td", {}, node.role),
      el("td", {}, serves),
      el("td", { class: "link-" + node.link.kind, title: node.link.description || "" },
        link + (node.directly_reachable ? "" : " (behind NAT)")),
      el("td", {}, sessions),
      el("td", {}, node.load.queued_chunks),
      el("td", {}, (100 * node.load.kv_pressure).toFixed(0) + "%"),
      el("td", {}, node.self ? "now" : node.heard_s.toFixed(1) + " s ago"),
    );
    body.append(row);
  }
  const links = view.links;
  $("link-summary").textContent =
    `${view.nodes.length} nodes; links: ${links.direct} direct, ${links.relay} through a relay` +
    (links.none ? `, ${links.none} down` : "");
}

function drawThroughput(view) {
  const now = view.throughput;
  let text = `this node: ${now.generated_tokens} tokens generated, ${now.active_generations} running`;
  if (previous && now.at_s > previous.throughput.at_s) {
    const span = now.at_s - previous.throughput.at_s;
    const generated = (now.generated_tokens - previous.throughput.generated_tokens) / span;
    const shard = (now.shard_tokens - previous.throughput.shard_tokens) / span;
    text += ` · ${generated.toFixed(1)} tokens/s generated · ${shard.toFixed(1)} tokens/s through its shard`;
  }
  $("throughput").textContent = text;
}

// What the process holds beside its shards (the API's tokenizer, JSON mode's vocabulary).
function outsideShard(memory) {
  const parts = Object.entries(memory.outside_bytes || {}).filter(([, bytes]) => bytes > 0)
    .map(([name, bytes]) => `${name} ${mib(bytes)} MiB`);
  return parts.length ? [el("span", { class: "muted" }, `not the shard's: ${parts.join(", ")}`)] : [];
}

function progressBar(fraction) {
  const bar = el("div", { class: "progress" + (fraction > 1 ? " over" : "") });
  bar.append(el("div", { class: "fill", style: `width:${(100 * Math.min(1, fraction)).toFixed(1)}%` }));
  return bar;
}

function drawSections(view) {
  const box = $("sections");
  box.replaceChildren();
  const placement = view.sections.placement;
  if (placement) {
    const layers = placement.layers ? ` layers [${placement.layers[0]}, ${placement.layers[1]})` : "";
    const model = placement.model ? ` of ${placement.model.name}` : "";
    const part = el("div", { id: "placement", "data-state": placement.state },
      el("strong", {}, "placement: "), `${placement.state}${layers}${model}`);
    const transfer = placement.transfer;
    if (transfer && !transfer.finished) {
      part.append(progressBar(transfer.fraction),
        el("span", { class: "muted" },
          `${mib(transfer.done_bytes)}/${mib(transfer.total_bytes)} MiB, ${mib(transfer.rate_bytes_per_s)} MiB/s` +
          (transfer.eta_s === null ? "" : `, ETA ${Math.round(transfer.eta_s)} s`)));
    }
    box.append(part);
  }
  const memory = view.sections.memory;
  if (memory) {
    const fraction = memory.budget_bytes ? memory.shard_bytes / memory.budget_bytes : 0;
    box.append(el("div", { id: "memory" }, el("strong", {}, "memory: "),
      `${mib(memory.rss_bytes)} MiB resident; the shard ${mib(memory.shard_bytes)} MiB of its ` +
      `${mib(memory.budget_bytes)} MiB budget`, progressBar(fraction),
      ...outsideShard(memory)));
  }
  // What this node's shard keeps of released prompts (empty while it serves nothing).
  const prefix = view.sections.prefix_cache;
  if (prefix && Object.keys(prefix).length) {
    box.append(el("div", { id: "prefix-cache", "data-limit": prefix.limit, "data-entries": prefix.entries },
      el("strong", {}, "prefix cache: "),
      prefix.limit ? `${prefix.entries} of ${prefix.limit} kept; ${prefix.hits} hits, ${prefix.misses} misses, ` +
        `${prefix.tokens_reused} tokens reused` : "off"));
  }
  for (const relay of view.relays) {
    const state = relay.registered ? "registered" : `not registered (${relay.problem || "connecting"})`;
    box.append(el("div", { class: "relay", "data-relay-id": relay.id, "data-registered": relay.registered },
      el("strong", {}, "relay: "), `${relay.short_id}@${relay.address}: `,
      el("span", { class: relay.registered ? "ok" : "bad" }, state)));
  }
  $("sections-box").hidden = box.childElementCount === 0;
}

function draw(view) {
  $("mesh-id").textContent = view.mesh_id ? `mesh ${view.mesh_id} · node ${view.short_id}` : "standalone";
  drawModels(view);
  drawNodes(view);
  drawThroughput(view);
  drawSections(view);
  const complete = view.models.find((model) => model.complete);
  servedModel = complete ? complete.name : null;
  previous = view;
}

function setState(state, text) {
  const badge = $("state");
  badge.dataset.state = state;
  badge.textContent = text;
}

async function poll() {
  try {
    const response = await fetch("/meshnode/mesh", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      setState("unauthorized", "API key needed");
    } else if (!response.ok) {
      setState("error", `mesh view: HTTP ${response.status}`);
    } else {
      draw(await response.json());
      setState("live", "live");
    }
  } catch (error) {
    setState("error", "node unreachable");
  }
  setTimeout(poll, POLL_MS);
}

// Server-sent events from /v1/completions, appended to the answer as they arrive.
async function send(event) {
  event.preventDefault();
  const answer = $("answer");
  const status = $("answer-status");
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  answer.textContent = "";
  status.textContent = "…";
  $("send").disabled = true;
  const started = performance.now();
  let tokens = 0;
  try {
    const body = {
      prompt,
      max_tokens: Number($("max-tokens").value) || 64,
      stream: true,
      stream_options: { include_usage: true },
    };
    if (servedModel) body.model = servedModel;
    const response = await fetch("/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      status.textContent = `HTTP ${response.status}: ${error?.error?.message ?? response.statusText}`;
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const line = buffered.slice(0, end).trim();
        buffered = buffered.slice(end + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          status.textContent = `failed mid-stream: ${chunk.error.message}`;
          return;
        }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) answer.textContent += choice.text || "";
      }
    }
    const seconds = (performance.now() - started) / 1000;
    status.textContent = `${tokens} tokens in ${seconds.toFixed(2)} s`;
    status.dataset.state = "done";
  } catch (error) {
    status.textContent = `failed: ${error}`;
  } finally {
    $("send").disabled = false;
  }
}

function start() {
  const linked = new URLSearchParams(location.hash.slice(1));
  // /console#key=KEY stores the key and takes it out of the address bar (a fragment never
  // reaches the server, but it would stay in the browser's history).
  if (linked.get("key")) {
    localStorage.setItem(KEY_STORAGE, linked.get("key"));
    linked.delete("key");
    const rest = linked.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    if (key.value) localStorage.setItem(KEY_STORAGE, key.value);
    else localStorage.removeItem(KEY_STORAGE);
  });
  $("prompt-form").addEventListener("submit", send);
  // A link can carry a prompt to send at once: /console#prompt=Hello&max_tokens=16.
  if (linked.get("prompt")) {
    $("prompt").value = linked.get("prompt");
    if (linked.get("max_tokens")) $("max-tokens").value = linked.get("max_tokens");
    $("prompt-form").requestSubmit();
  }
  poll();
}

start();
