// deepinfer_kit trace viewer: renders step i of the embedded trace (schema version 1) into
// one panel per mechanism. Elements are keyed (by request id, block id, expert) and updated in
// place, so CSS transitions move one state into the next; every rendered fact is also a data-*
// attribute, which is what the browser test reads back.
(function () {
  "use strict";
  var doc = JSON.parse(document.getElementById("trace-data").textContent);
  var steps = doc.steps, meta = doc.meta, P = meta.block_size;
  var current = -1, timer = null;
  var $ = function (id) { return document.getElementById(id); };

  function el(tag, cls, attrs, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function show_text(t) { return t ? JSON.stringify(t) : ""; }
  function setData(e, data) { for (var k in data) e.setAttribute("data-" + k, String(data[k])); }

  // Make `parent`'s keyed children (data-key) exactly `items`, in order: reuse, create, remove.
  function sync(parent, items, keyOf, make, update, keep) {
    var old = {}, kids = parent.querySelectorAll(":scope > [data-key]");
    for (var i = 0; i < kids.length; i++) old[kids[i].getAttribute("data-key")] = kids[i];
    var anchor = keep || null;
    items.forEach(function (item, i) {
      var key = String(keyOf(item, i)), node = old[key];
      if (!node) { node = make(item, i); node.setAttribute("data-key", key); }
      delete old[key];
      update(node, item, i);
      var next = anchor ? anchor.nextSibling : parent.firstChild;
      if (node !== next) parent.insertBefore(node, next);
      anchor = node;
    });
    for (var k in old) parent.removeChild(old[k]);
  }

  // FLIP: chips keep their screen position across queue moves, then glide to the new one.
  function moveChips(render) {
    var before = {};
    document.querySelectorAll(".chip").forEach(function (c) { before[c.dataset.id] = c.getBoundingClientRect(); });
    render();
    document.querySelectorAll(".chip").forEach(function (c) {
      var b = before[c.dataset.id]; if (!b) return;
      var a = c.getBoundingClientRect(), dx = b.left - a.left, dy = b.top - a.top;
      if (!dx && !dy) return;
      c.style.transition = "none"; c.style.transform = "translate(" + dx + "px," + dy + "px)";
      requestAnimationFrame(function () { requestAnimationFrame(function () {
        c.style.transition = "transform .45s ease, background-color .35s"; c.style.transform = "";
      }); });
    });
  }

  function renderQueues(s) {
    var chips = {};
    document.querySelectorAll(".chip").forEach(function (c) { chips[c.dataset.id] = c; });
    moveChips(function () {
      ["waiting", "running", "finished"].forEach(function (q) {
        var box = document.querySelector('.queue[data-queue="' + q + '"]');
        sync(box, s.queues[q], function (id) { return id; }, function (id) {
          return chips[id] || el("span", "chip", { "data-id": id }, id);
        }, function (node, id) {
          node.classList.toggle("preempted", s.preempted.indexOf(id) >= 0);
          node.classList.toggle("just-finished", s.finished.indexOf(id) >= 0);
        }, box.querySelector("h3"));
      });
    });
    var bar = $("budget");
    setData(bar, { budget: s.budget, used: s.batched_tokens });
    sync(bar, s.chunks, function (c) { return c.request; }, function () { return el("div", "seg"); },
      function (node, c) {
        setData(node, { request: c.request, q: c.q, kind: c.kind });
        node.style.width = (100 * c.q / s.budget) + "%";
        node.textContent = c.request + " " + c.q;
        node.title = c.request + ": " + c.kind + " positions [" + c.start + ", " + (c.start + c.q) + ")" + (c.cached ? ", " + c.cached + " cached" : "");
      });
    $("budget-label").innerHTML = "used " + s.batched_tokens + " of B<sub>t</sub> = " + s.budget +
      " tokens<i style='background:var(--prefill)'></i>prefill<i style='background:var(--decode)'></i>decode";
  }

  function renderBlocks(s) {
    var b = s.blocks, copies = {}, shared = {};
    b.copies.forEach(function (c) { copies[c[1]] = c[0]; });
    b.shared.forEach(function (x) { shared[x] = 1; });
    var rows = Object.keys(b.tables).map(function (id) { return [id, b.tables[id]]; });
    sync($("tables"), rows, function (r) { return r[0]; }, function (r) {
      var row = el("div", "trow"); row.appendChild(el("span", "name", {}, r[0])); return row;
    }, function (row, r) {
      var hits = b.prefix_hits[r[0]] || [], win = {};
      ((b.windows || {})[r[0]] || []).forEach(function (g) { g.forEach(function (x) { win[x] = (win[x] || 0) + 1; }); });
      setData(row, { request: r[0] });
      sync(row, r[1], function (phys, i) { return i; }, function () { return el("div", "blk"); },
        function (node, phys, i) {
          setData(node, { logical: i, physical: phys, ref: b.ref_counts[phys], shared: shared[phys] ? 1 : 0,
            hit: i < hits.length ? 1 : 0, copy: phys in copies ? 1 : 0,
            window: b.windows ? (win[phys] ? 1 : 0) : "" });
          node.innerHTML = "";
          node.appendChild(document.createTextNode(String(phys)));
          node.appendChild(el("small", "", {}, "ref " + b.ref_counts[phys]));
          node.title = r[0] + ": logical " + i + " (tokens " + i * P + "-" + ((i + 1) * P - 1) + ") -> physical " + phys +
            (phys in copies ? ", copy of " + copies[phys] : "") +
            (b.windows ? (win[phys] ? ", in a sliding window" : ", left every sliding window") : "");
        }, row.querySelector(".name"));
    });
    var cached = {}, evicted = {};
    b.cached.forEach(function (x) { cached[x] = 1; });
    b.evicted.forEach(function (x) { evicted[x] = 1; });
    sync($("pool"), b.ref_counts, function (r, i) { return i; }, function () { return el("div", "cell"); },
      function (node, ref, i) {
        var state = ref > 1 ? "shared" : ref === 1 ? "used" : cached[i] ? "cached" : "free";
        setData(node, { block: i, ref: ref, state: state, evicted: evicted[i] ? 1 : 0 });
        node.innerHTML = ""; node.appendChild(document.createTextNode(String(i)));
        node.appendChild(el("small", "", {}, ref ? "x" + ref : ""));
      });
    var ev = $("block-events");
    setData(ev, { free: b.num_free, evicted: b.num_evicted, copies: b.copies.length });
    ev.innerHTML = "";
    ev.appendChild(el("span", "", {}, "free + evictable: " + b.num_free + " / " + meta.num_blocks));
    ev.appendChild(el("span", "", {}, "copy-on-write: " + (b.copies.length ? b.copies.map(function (c) { return c[0] + "\u2192" + c[1]; }).join(", ") : "none")));
    ev.appendChild(el("span", "", {}, "evicted: " + b.num_evicted + (b.evicted.length ? " (" + b.evicted.join(", ") + ")" : "")));
    var hitIds = Object.keys(b.prefix_hits);
    ev.appendChild(el("span", "", {}, "prefix hits: " + (hitIds.length ? hitIds.map(function (id) { return id + " " + b.prefix_hits[id].length + " blocks"; }).join(", ") : "none")));
  }

  function renderSampling(s) {
    var box = $("draws");
    sync(box, s.sampling, function (d, i) { return d.request + "/" + i; }, function () {
      var d = el("div", "draw"); d.appendChild(el("div", "head")); d.appendChild(el("div", "cands")); return d;
    }, function (node, d) {
      setData(node, { request: d.request, token: d.token, filter: d.filter, committed: d.committed ? 1 : 0 });
      node.querySelector(".head").innerHTML = "";
      node.querySelector(".head").appendChild(document.createTextNode(d.request + " drew " + d.token + " " + show_text(d.text) + " "));
      node.querySelector(".head").appendChild(el("span", "filter", {}, "[" + d.filter + "]" + (d.committed ? "" : " dropped by the commit")));
      sync(node.querySelector(".cands"), d.candidates, function (c) { return c.token; }, function () {
        var c = el("div", "cand"); c.appendChild(el("span", "lbl")); c.appendChild(el("div", "pbar")); c.appendChild(el("span", "p")); return c;
      }, function (cn, c) {
        var p = c.logprob === null ? 0 : Math.exp(c.logprob);
        setData(cn, { token: c.token, rank: c.rank, prob: p.toFixed(4) });
        cn.classList.toggle("chosen", c.token === d.token);
        cn.querySelector(".lbl").textContent = "#" + c.rank + " " + c.token + " " + show_text(c.text);
        cn.querySelector(".pbar").style.width = Math.max(1, 180 * p) + "px";
        cn.querySelector(".p").textContent = (100 * p).toFixed(1) + "%";
      });
    });
    if (!s.sampling.length) box.innerHTML = "<div class='empty'>no token drawn in this step</div>";
    else { var e = box.querySelector(".empty"); if (e) e.remove(); }
  }

  function renderSpec(s) {
    var rows = s.chunks.filter(function (c) { return c.verified > 0 || c.drafted.length > 0; });
    var box = $("specs");
    setData(box, { enabled: meta.speculative ? 1 : 0 });
    sync(box, rows, function (c) { return c.request; }, function () { return el("div", "spec"); }, function (node, c) {
      setData(node, { request: c.request, drafted: c.drafted.length, verified: c.verified, accepted: c.accepted });
      node.innerHTML = ""; node.appendChild(el("span", "name", {}, c.request));
      c.drafted.forEach(function (t, i) {
        node.appendChild(el("span", "dtok", { "data-token": t, "data-accepted": i < c.accepted ? 1 : 0 }, String(t)));
      });
      node.appendChild(el("span", "", {}, " verified " + c.verified + ", accepted " + c.accepted + ", committed " + c.sampled.length));
    });
    var empty = box.querySelector(".empty");
    if (!rows.length && !empty) box.appendChild(el("div", "empty", {}, meta.speculative ? "no drafts in this step" : "speculation is off in this run"));
    if (rows.length && empty) empty.remove();
  }

  function renderTokens(i) {
    var seqs = {}, order = [];
    for (var k = 0; k <= i; k++) steps[k].tokens.forEach(function (t) {
      if (!seqs[t.request]) { seqs[t.request] = []; order.push(t.request); }
      seqs[t.request].push(t);
    });
    var now = steps[i].step;
    sync($("seqs"), order, function (id) { return id; }, function (id) {
      var r = el("div", "seq"); r.appendChild(el("span", "name", {}, id)); return r;
    }, function (row, id) {
      setData(row, { request: id, count: seqs[id].length });
      sync(row, seqs[id], function (t) { return t.index; }, function () { return el("span", "tok"); }, function (node, t) {
        setData(node, { index: t.index, token: t.token, "sampled-in": t.sampled_in, "committed-in": t.committed_in,
          late: t.committed_in > t.sampled_in ? 1 : 0 });
        node.classList.toggle("fresh", t.sampled_in === now);
        node.innerHTML = ""; node.appendChild(document.createTextNode(String(t.token) + " "));
        node.appendChild(el("small", "", {}, "s" + t.sampled_in + " c" + t.committed_in));
      }, row.querySelector(".name"));
    });
  }

  function renderExperts(s) {
    var layers = s.experts || [];
    var box = $("layers");
    sync(box, layers, function (l, i) { return i; }, function (l, i) {
      var d = el("div", "layer"); d.appendChild(el("span", "name", {}, "layer " + i)); return d;
    }, function (node, counts, li) {
      var max = Math.max.apply(null, counts.concat([1]));
      setData(node, { layer: li, total: counts.reduce(function (a, b) { return a + b; }, 0) });
      sync(node, counts, function (c, e) { return e; }, function () { var b = el("div", "ebar"); b.appendChild(el("span")); return b; },
        function (bar, c, e) {
          setData(bar, { expert: e, count: c });
          bar.style.height = (60 * c / max) + "px";
          bar.firstChild.textContent = String(c);
          bar.title = "expert " + e + ": " + c + " tokens";
        }, node.querySelector(".name"));
    });
    var empty = box.querySelector(".empty");
    if (!layers.length && !empty) box.appendChild(el("div", "empty", {}, "no MoE layer in this model"));
    renderEplb(s);
  }

  // Mean / max of a layer's GPU loads, 3 decimals (1 when nothing ran).
  function balancedness(loads) {
    var max = Math.max.apply(null, loads), sum = loads.reduce(function (a, v) { return a + v; }, 0);
    return (max > 0 ? sum / loads.length / max : 1).toFixed(3);
  }

  // Live EPLB: per layer, each GPU's token copies this step before replica selection (an
  // even split of each expert's copies over its replicas; grey bar) and as dispatched
  // (green bar), and its slots -> expert
  // (the placement the step ran under); slots a rebalance just before this step changed
  // are marked, with the rebalance's balancedness before -> after.
  function renderEplb(s) {
    var box = $("eplb"), x = s.eplb, em = meta.eplb;
    box.hidden = !x;
    if (!x) return;
    var r = x.rebalance, per = em.num_slots / em.num_gpus;
    var note = $("rebalance");
    setData(note, { rebalanced: r ? 1 : 0, moved: r ? r.moved_slots : 0,
      before: r ? r.balancedness_before.toFixed(4) : "", after: r ? r.balancedness_after.toFixed(4) : "" });
    note.textContent = r ? "rebalanced before this step: " + r.moved_slots + " slots moved, balancedness " +
      r.balancedness_before.toFixed(3) + " \u2192 " + r.balancedness_after.toFixed(3) + " (on its window)"
      : "placement unchanged (E = " + em.num_experts + " experts on " + em.num_slots + " slots over " + em.num_gpus +
        " GPUs; rebalance every " + em.interval + " steps" + (em.dispatch ? "; replica selector " + em.dispatch : "") + ")";
    note.classList.toggle("fresh", !!r);
    sync($("eplb-layers"), x.gpu_loads, function (l, i) { return i; }, function (l, i) {
      var d = el("div", "elayer"), name = el("span", "name", {}, "layer " + i);
      name.appendChild(el("small", "bal")); d.appendChild(name); return d;
    }, function (node, loads, li) {
      var before = x.gpu_loads_before ? x.gpu_loads_before[li] : null;
      var max = Math.max.apply(null, loads.concat(before || [], [1])), changed = {};
      (r ? r.changed[li] : []).forEach(function (slot) { changed[slot] = 1; });
      var bal = node.querySelector(".bal"), after = balancedness(loads), was = before ? balancedness(before) : "";
      setData(node, { layer: li });
      setData(bal, { before: was, after: after });
      bal.textContent = before ? "mean/max " + was + " \u2192 " + after : "mean/max " + after;
      bal.title = "balancedness (mean / max GPU load) of this step" + (before ? ": before selection \u2192 as dispatched" : "");
      sync(node, loads, function (g, gi) { return gi; }, function () {
        var g = el("div", "gpu"); g.appendChild(el("div", "gbar-before")); g.appendChild(el("div", "gbar"));
        g.appendChild(el("span", "glabel")); g.appendChild(el("div", "slots")); return g;
      }, function (g, load, gi) {
        var b = before ? before[gi] : load;
        setData(g, { gpu: gi, load: load, before: b });
        g.querySelector(".gbar-before").style.width = (100 * b / max) + "%";
        g.querySelector(".gbar").style.width = (100 * load / max) + "%";
        g.querySelector(".glabel").textContent = "GPU " + gi + ": " + load + (before ? " (before selection " + b + ")" : "");
        var slots = [];
        for (var k = gi * per; k < (gi + 1) * per; k++) slots.push(k);
        sync(g.querySelector(".slots"), slots, function (k) { return k; }, function () { return el("span", "slot"); }, function (sn, k) {
          setData(sn, { slot: k, expert: x.phy2log[li][k], count: x.slots[li][k], changed: changed[k] ? 1 : 0 });
          sn.innerHTML = ""; sn.appendChild(document.createTextNode("e" + x.phy2log[li][k]));
          sn.appendChild(el("small", "", {}, " " + x.slots[li][k]));
          sn.title = "slot " + k + " holds expert " + x.phy2log[li][k] + ": " + x.slots[li][k] + " token copies" + (changed[k] ? " (changed by the rebalance)" : "");
        });
      }, node.querySelector(".name"));
    });
  }

  function show(i) {
    i = Math.max(0, Math.min(steps.length - 1, i));
    if (!steps.length) return;
    current = i;
    var s = steps[i];
    renderQueues(s); renderBlocks(s); renderSampling(s); renderSpec(s); renderTokens(i); renderExperts(s);
    document.querySelectorAll("main > section").forEach(function (p) { p.setAttribute("data-step", String(s.step)); });
    $("scrub").value = String(i);
    var label = $("step-label");
    setData(label, { index: i, step: s.step });
    label.textContent = "step " + s.step + " (" + (i + 1) + " / " + steps.length + ")" + (s.committed_in !== s.step ? ", committed in " + s.committed_in : "");
    if (location.hash !== "#step=" + i) history.replaceState(null, "", "#step=" + i);
  }

  function play() {
    if (timer) { clearInterval(timer); timer = null; $("btn-play").innerHTML = "&#x25B6; play"; $("btn-play").dataset.playing = "0"; return; }
    if (current >= steps.length - 1) show(0);
    $("btn-play").innerHTML = "&#x275A;&#x275A; pause"; $("btn-play").dataset.playing = "1";
    timer = setInterval(function () { if (current >= steps.length - 1) play(); else show(current + 1); }, 700);
  }

  $("meta").textContent = (meta.model ? meta.model + ": " : "") + steps.length + " steps, " + Object.keys(doc.requests).length +
    " sequences, " + meta.num_blocks + " blocks of " + P + " tokens" + (meta.overlap ? ", overlapped" : "") +
    (meta.speculative ? ", speculative decoding" : "") + "; schema " + doc.schema + " v" + doc.version;
  $("scrub").max = String(Math.max(0, steps.length - 1));
  $("scrub").addEventListener("input", function () { show(parseInt(this.value, 10)); });
  $("btn-first").onclick = function () { show(0); };
  $("btn-prev").onclick = function () { show(current - 1); };
  $("btn-next").onclick = function () { show(current + 1); };
  $("btn-last").onclick = function () { show(steps.length - 1); };
  $("btn-play").onclick = play;
  document.addEventListener("keydown", function (e) {
    if (e.target && e.target.tagName === "INPUT" && e.target.type !== "range") return;
    if (e.key === "ArrowRight") { show(current + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft") { show(current - 1); e.preventDefault(); }
    else if (e.key === "Home") show(0);
    else if (e.key === "End") show(steps.length - 1);
    else if (e.key === " ") { play(); e.preventDefault(); }
  });
  var m = /step=(\d+)/.exec(location.hash);
  show(m ? parseInt(m[1], 10) : 0);
  window.deepinferViewer = { show: show, current: function () { return current; }, doc: doc };
})();
