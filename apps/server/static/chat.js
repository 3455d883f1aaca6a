// The chat page of `edgespec serve`: streams replies from this server's
// /v1/chat/completions (server-sent events), shows them as markdown and what speculation
// did for each, and keeps the conversation across reloads.
"use strict";

const $ = (id) => document.getElementById(id);
const SAMPLING = ["temperature", "top_k", "top_p", "repetition_penalty"];
const SETTINGS = ["system", ...SAMPLING, "max_tokens", "mode"];
const CONVERSATION = "edgespec.conversation";  // the tab's session storage: the messages, as JSON
// messages: {role, content} as sent to the server, and for replies their stats line
const state = { messages: [], controller: null, model: "edgespec" };
const markdown = new marked.Marked({ gfm: true, breaks: true });

function authHeaders() {
  const key = $("api_key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text) {
  $("status").textContent = text;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (response.status === 401) {
      $("model").textContent = "";
      setStatus("This server needs an API key: paste it under Settings.");
      return;
    }
    const body = await response.json();
    state.model = body.data[0].id;
    const defaults = body.data[0].sampling || {};
    for (const id of SAMPLING) {  // a blank field is left out of requests: the default
      if (defaults[id] !== undefined) $(id).placeholder = String(defaults[id]);
    }
    $("model").textContent = state.model;
    setStatus("");
  } catch (error) {
    setStatus("Cannot reach the server: " + error.message);
  }
}

// A reply's markdown as HTML that cannot run anything: DOMPurify drops scripts, event
// handlers and javascript: links that marked passes through from the reply. Swapped in
// whole, so the page changes once per render.
function renderMarkdown(element, text) {
  const html = DOMPurify.sanitize(markdown.parse(text),
                                  { RETURN_DOM_FRAGMENT: true, FORBID_ATTR: ["style"] });
  for (const pre of html.querySelectorAll("pre")) {
    const block = document.createElement("div");
    block.className = "code-block";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    pre.replaceWith(block);
    block.append(copy, pre);  // beside the pre, not in it: stays put when the code scrolls
  }
  element.replaceChildren(html);
}

// Streamed text rendered at most once per frame: rendering re-parses the whole reply, so
// once per piece would make long replies quadratic. The first piece shows at once.
function liveRenderer(reply) {
  let text = "", shown = null, frame = 0;
  const render = () => {
    frame = 0;
    if (text === shown) return;
    renderMarkdown(reply.body, text);
    shown = text;
    reply.div.scrollIntoView({ block: "end" });
  };
  return {
    update(next) {
      text = next;
      if (shown === null) render();
      else if (!frame) frame = requestAnimationFrame(render);
    },
    flush() {
      cancelAnimationFrame(frame);
      render();
    },
  };
}

async function copyCode(event) {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const code = button.parentElement.querySelector("pre");
  try {
    await navigator.clipboard.writeText(code.textContent);
    button.textContent = "Copied";
  } catch (_) {  // no clipboard API (plain http to another host): select it for Ctrl+C
    getSelection().selectAllChildren(code);
    button.textContent = "Selected";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const body = document.createElement("div");
  body.className = "text";
  if (role === "assistant") renderMarkdown(body, text);
  else body.textContent = text;  // what the user typed shows as typed
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(body, stats);
  $("conversation").append(div);
  div.scrollIntoView({ block: "end" });
  return { div, body, stats };
}

const integer = (v) => parseInt(v, 10);

function number(id, parse) {
  const value = parse($(id).value);
  return Number.isFinite(value) ? value : undefined;  // blank: the server's default
}

function requestBody() {
  const system = $("system").value.trim();
  const turns = state.messages.map(({ role, content }) => ({ role, content }));
  const messages = system ? [{ role: "system", content: system }, ...turns] : turns;
  return {
    model: state.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature", parseFloat), top_k: number("top_k", integer),
    top_p: number("top_p", parseFloat),
    repetition_penalty: number("repetition_penalty", parseFloat),
    max_tokens: number("max_tokens", integer), mode: $("mode").value,
  };
}

// Server-sent events from a fetch body: each `data:` payload, parsed, until [DONE].
async function* serverEvents(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  if (response.status === 401) return "401: the API key is missing or wrong (Settings).";
  try {
    return response.status + ": " + (await response.json()).error.message;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

function statsLine(usage) {
  const s = usage.edgespec || {};
  const parts = [usage.completion_tokens + " tokens"];
  if (s.tokens_per_s !== undefined) parts.push(s.tokens_per_s.toFixed(1) + " tokens/s");
  if (s.mode === "speculative") {
    parts.push(s.accepted_per_round.toFixed(2) + " accepted/round",
               "accepted " + s.accepted + "/" + s.drafted + " drafts");
  } else if (s.mode) {
    parts.push(s.mode);
  }
  return parts.join(" \u00b7 ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  const messages = state.messages;  // "New chat" mid-reply starts another list
  messages.push({ role: "user", content: text });
  const asked = addMessage("user", text);
  const reply = addMessage("assistant", "");
  const live = liveRenderer(reply);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  setStatus("");
  let content = "", usage = null, failure = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(requestBody()), signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of serverEvents(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        content += delta.content;
        live.update(content);
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") failure = error.message;
  }
  live.flush();
  const stopped = controller.signal.aborted;
  if (failure && !content) {
    // nothing came back: take the message back so that it can be sent again
    messages.pop();
    asked.div.classList.add("failed");
    reply.div.remove();
    $("prompt").value = text;
    setStatus(failure);
  } else {
    // a stopped or broken reply stays in the conversation as far as it got, as in the
    // terminal chat, so the next turn answers what the user saw
    reply.stats.textContent = stopped ? "stopped" : usage ? statsLine(usage) : "";
    messages.push({ role: "assistant", content, stats: reply.stats.textContent });
    if (messages === state.messages) saveConversation();  // unless New chat came since
    if (failure) setStatus(failure);
  }
  state.controller = null;
  setBusy(false);
  $("prompt").focus();
}

function stop() {
  if (state.controller) state.controller.abort();  // the server cancels the generation
}

function newChat() {
  stop();
  state.messages = [];
  $("conversation").replaceChildren();
  sessionStorage.removeItem(CONVERSATION);
  setStatus("");
}

// saved once a reply is complete: a reload mid-reply loses only that turn; each tab keeps
// its own conversation, so several tabs chat side by side
function saveConversation() {
  try {
    sessionStorage.setItem(CONVERSATION, JSON.stringify(state.messages));
  } catch (_) {
    setStatus("The conversation is too long to keep across reloads (session storage is full).");
  }
}

// the tab's conversation before a reload; a stored value that is not one is dropped
function restoreConversation() {
  let saved = null;
  try {
    saved = JSON.parse(sessionStorage.getItem(CONVERSATION));
  } catch (_) { /* not JSON: dropped below */ }
  const valid = Array.isArray(saved) && saved.every((m) => m && typeof m.content === "string"
    && (m.role === "user" || m.role === "assistant"));
  if (!valid) {
    sessionStorage.removeItem(CONVERSATION);
    return;
  }
  state.messages = saved;
  for (const message of saved) {
    const shown = addMessage(message.role, message.content);
    if (typeof message.stats === "string") shown.stats.textContent = message.stats;
  }
}

// settings last between visits (local storage); the API key only for this tab's life
function restoreSettings() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem("edgespec." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("edgespec." + id, $(id).value));
  }
  $("api_key").value = sessionStorage.getItem("edgespec.api_key") || "";
  $("api_key").addEventListener("change", () => {
    sessionStorage.setItem("edgespec.api_key", $("api_key").value.trim());
    loadModel();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  restoreSettings();
  restoreConversation();
  $("conversation").addEventListener("click", copyCode);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  loadModel();
  $("prompt").focus();
});
