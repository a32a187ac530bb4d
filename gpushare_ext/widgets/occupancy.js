// @ts-check
/**
 * The occupancy view of gpushare: one picture per GPU (MIG layout or "MIG off: whole GPU"
 * with its profiles, memory per user, a utilisation sparkline, who holds it) plus the queue
 * and the viewer's own sessions.
 *
 * One ES module, two users:
 *  - the notebook widget (anywidget loads this file as `_esm`; see occupancy.py), which
 *    uses the default export `{ render }`;
 *  - the JupyterLab panel (labextension/src/panel.ts), which imports `renderSnapshot` and
 *    `renderMessage` so the panel and the widget draw the same thing.
 *
 * It only draws: no network, no timers, no imports. Data comes in as the JSON form of
 * `gpushare_ext.protocol.Snapshot` (`protocol.snapshot_to_builtins`). Anonymisation is
 * the broker's job; this file shows `LeaseView.user` as it arrives.
 *
 * Labels, reasons and names are other people's words. The broker sends them as plain
 * text (one line, escapes and bidi controls shown as stand-ins: gpushare_ext/plain_text.py),
 * and this file puts text into the page only as `textContent`, `title` or an SVG
 * attribute, never as HTML, so "<b>" or "[bold red]" in a label shows as those characters.
 */

/** Memory slices of the MIG layout of A100/H100/H200 (what profiles' placements index). */
export const MEMORY_SLICES = 8;

/**
 * @typedef {{id: number, name: string, slice_count: number, memory_mib: number,
 *   multiprocessor_count: number, instance_count: number, memory_slices: number,
 *   placements: number[], media_extensions: boolean}} MigProfile
 * @typedef {{uuid: string, profile_id: number, name: string, gpu_instance_id: number,
 *   compute_instance_id: number, memory_mib: number, multiprocessor_count: number,
 *   start: number, size: number}} MigInstance
 * @typedef {{index: number, name: string, uuid: string, memory_total_mib: number,
 *   multiprocessor_count: number, compute_capability: number[], driver_version: string,
 *   mig_enabled: boolean, mig_pending: boolean, compute_mode: number,
 *   profiles: MigProfile[], instances: MigInstance[], simulated: boolean}} DeviceInfo
 * @typedef {{info: DeviceInfo, drained: boolean, memory_used_mib: number,
 *   memory_leased_mib: number, utilization_pct: number, utilization_history: number[],
 *   holders: string[], memory_outside_leases_mib?: Record<string, number>,
 *   timeline?: TimelineSpan[]}} DeviceView
 * @typedef {{start: number, end?: number|null, level: number}} TimelinePause
 * @typedef {{lease_id: string, user: string, own: boolean, priority: number,
 *   start: number, end?: number|null, pauses?: TimelinePause[], gang?: string,
 *   rank?: number|null}} TimelineSpan
 * @typedef {"queued"|"running"|"paused"|"evicted"|"released"|"refused"|"revoked"} LeaseState
 * @typedef {{lease_id: string, user: string, own: boolean, priority: number,
 *   state: LeaseState, device_index: number|null, mig_uuid: string|null,
 *   memory_bytes: number, sm_share: number, since_s: number, waited_s: number,
 *   position?: number|null, reason?: string, label?: string, pid?: number|null,
 *   notebook?: string, preemption_level?: number|null,
 *   estimate_s?: number|null, gang?: string, rank?: number|null}} LeaseView
 * @typedef {{host: string, node: string, broker_pid: number, mode: string,
 *   inventory: string, inventory_description: string, time: number, you: string,
 *   is_admin: boolean, devices: DeviceView[], leases: LeaseView[],
 *   queue_by_priority: Record<string, number>, notes?: string[],
 *   timeline_window_s?: number}} Snapshot
 * @typedef {{action: "drain"|"undrain"|"cancel", device?: number, lease_id?: string}} AdminRequest
 * @typedef {{onAdmin?: (request: AdminRequest) => void, adminHint?: string}} RenderOptions
 * @typedef {LeaseView & {ranks: number, states: string, devices: number[]}} LeaseRow
 * @typedef {TimelineSpan & {ranks: number}} TimelineRow
 */

const MIB = 1024 * 1024;
/** @type {Record<string, number>} */
const PRIORITY_CLASSES = { low: 50, normal: 150, high: 250 };
const ACTIVE_STATES = new Set(["running", "paused", "evicted"]);
/** The label the broker gives the lease that holds a parked notebook's memory. */
const PARKED_LABEL = "parked idle session";

/**
 * Create an element with a class, text and children.
 * @param {string} tag
 * @param {string} [cls]
 * @param {string} [text]
 * @param {(Node|null|undefined)[]} [children]
 * @returns {HTMLElement}
 */
function h(tag, cls, text, children) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  for (const child of children || []) if (child) node.appendChild(child);
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

/**
 * @param {string} tag
 * @param {Record<string, string|number>} attrs
 * @returns {SVGElement}
 */
function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

/**
 * Priority number as the user says it: "high", or "high (260)" off the class's middle.
 * @param {number} value
 * @returns {string}
 */
export function describePriority(value) {
  const name = ["low", "normal", "high"][
    Math.floor(Math.min(Math.max(value, 0), 299) / 100)
  ];
  return PRIORITY_CLASSES[name] === value ? name : `${name} (${value})`;
}

/**
 * @param {number} seconds
 * @returns {string}
 */
export function formatDuration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

/**
 * @param {number} mib
 * @returns {string}
 */
export function formatMiB(mib) {
  // As the CLI rounds (units.format_size): one decimal below 100, none from there.
  /** @type {Array<[string, number]>} */
  const units = [
    ["TiB", 1024 * 1024],
    ["GiB", 1024],
  ];
  for (const [unit, size] of units) {
    if (mib >= size) {
      const value = mib / size;
      return `${value.toFixed(value >= 100 ? 0 : 1)} ${unit}`;
    }
  }
  if (mib <= 0) return "0 B";
  return `${mib >= 100 ? Math.round(mib) : mib.toFixed(1)} MiB`;
}

/**
 * One line for the status bar, from the viewer's point of view: "GPU: running, 2
 * queued" while one of the viewer's leases holds a GPU, "GPU: queued, position 2 of 3"
 * while the viewer only waits (not "queued, 1 queued", which counted the viewer's own
 * request as someone else's).
 * @param {Snapshot} snapshot
 * @returns {string}
 */
export function statusSummary(snapshot) {
  const own = snapshot.leases.filter((l) => l.own);
  // A gang queues as one request (its ranks share a place), as positions count them.
  const queued = groupLeases(snapshot.leases).filter(
    (l) => l.state === "queued",
  ).length;
  /** @type {LeaseState[]} */
  const order = ["running", "paused", "evicted", "queued"];
  const mine = order.find((state) => own.some((l) => l.state === state));
  if (mine === "queued") {
    const places = own
      .filter((l) => l.state === "queued" && l.position != null)
      .map((l) => Number(l.position));
    if (!places.length) return "GPU: queued";
    const of = queued > 1 ? ` of ${queued}` : "";
    return `GPU: queued, position ${Math.min(...places)}${of}`;
  }
  const held = snapshot.leases.some((l) => ACTIVE_STATES.has(l.state));
  const head = mine ? mine : held ? "busy" : "idle";
  return queued ? `GPU: ${head}, ${queued} queued` : `GPU: ${head}`;
}

// ---- a gang as one request (status_view.requests_of and timeline_rows do the same)

/**
 * From furthest from running to running: a gang trains only while every rank runs, so
 * a gang's row takes the state of the rank that holds the others back.
 * @type {string[]}
 */
const HOLDING_BACK = ["queued", "evicted", "paused", "running"];

/**
 * The leases as requests, in the place of each request's first lease: a gang's ranks
 * (same `gang`) become one row under the gang's id, with their count and devices, their
 * memory and SM shares summed (pass one device's leases for what the gang holds there),
 * the state of the rank furthest from running and, where the ranks differ, `states`
 * counting them ("paused 1, running 1"). It must not drop a lease nor reorder requests.
 * @param {LeaseView[]} leases
 * @returns {LeaseRow[]}
 */
export function groupLeases(leases) {
  /** @type {Map<string, LeaseView[]>} */
  const requests = new Map();
  for (const l of leases) {
    const id = l.gang || l.lease_id;
    requests.set(id, [...(requests.get(id) || []), l]);
  }
  return [...requests].map(([id, ranks]) => {
    /** @type {Map<LeaseState, number>} */
    const counts = new Map();
    for (const l of ranks) counts.set(l.state, (counts.get(l.state) || 0) + 1);
    const states = [...counts.keys()].sort(
      (a, b) => HOLDING_BACK.indexOf(a) - HOLDING_BACK.indexOf(b),
    );
    const reasons = new Set(ranks.flatMap((l) => (l.reason ? [l.reason] : [])));
    return {
      ...ranks[0],
      lease_id: id,
      ranks: ranks.length,
      state: states[0],
      states:
        states.length === 1
          ? states[0]
          : states.map((state) => `${state} ${counts.get(state)}`).join(", "),
      devices: [
        ...new Set(
          ranks.flatMap((l) =>
            l.device_index === null ? [] : [l.device_index],
          ),
        ),
      ],
      memory_bytes: ranks.reduce((total, l) => total + l.memory_bytes, 0),
      sm_share: ranks.reduce((total, l) => total + l.sm_share, 0),
      since_s: Math.min(...ranks.map((l) => l.since_s)),
      // Ranks in one state share the request's reason (a queued gang's is its first
      // rank's); ranks in different states each say why, named by their rank.
      reason:
        states.length === 1
          ? [...reasons].join("; ")
          : ranks
              .filter((l) => l.reason)
              .map((l) => `rank ${l.rank}: ${l.reason}`)
              .join("; "),
    };
  });
}

/**
 * When every span was paused at once, at the highest level any of them was held.
 * The intersection, not the union: a rank that kept running (one that could not be
 * paused) still used the device, so a pause is drawn only where all of them gave it
 * up; the level is the costliest rung any of them paid.
 * @param {TimelineSpan[]} spans
 * @returns {TimelinePause[]}
 */
function commonPauses(spans) {
  /** @param {TimelineSpan} span */
  const open = (span) =>
    (span.pauses || []).map((p) => ({ ...p, end: p.end ?? Infinity }));
  let common = open(spans[0]);
  for (const span of spans.slice(1)) {
    const theirs = open(span);
    common = common
      .flatMap((a) =>
        theirs.map((b) => ({
          start: Math.max(a.start, b.start),
          end: Math.min(a.end, b.end),
          level: Math.max(a.level, b.level),
        })),
      )
      .filter((p) => p.start < p.end)
      .sort((a, b) => a.start - b.start);
  }
  return common.map((p) => ({ ...p, end: p.end === Infinity ? null : p.end }));
}

/**
 * One device's timeline as requests: a gang's spans become one bar under its id, from
 * its first rank's start to its last rank's end (open while any rank is held), paused
 * where all of them were; `ranks` counts its ranks on this device (1 for a lease).
 * @param {TimelineSpan[]} spans
 * @returns {TimelineRow[]}
 */
export function groupSpans(spans) {
  // Keyed by the span itself outside gangs: a lease granted twice keeps both its spans.
  /** @type {Map<string|TimelineSpan, TimelineSpan[]>} */
  const requests = new Map();
  for (const span of spans) {
    const key = span.gang || span;
    requests.set(key, [...(requests.get(key) || []), span]);
  }
  return [...requests.values()].map((ranks) => {
    const first = ranks[0];
    if (!first.gang) return { ...first, ranks: 1 };
    const ends = ranks.map((span) => span.end ?? null);
    return {
      ...first,
      lease_id: first.gang,
      ranks: ranks.length,
      start: Math.min(...ranks.map((span) => span.start)),
      end: ends.includes(null)
        ? null
        : Math.max(.../** @type {number[]} */ (ends)),
      pauses: commonPauses(ranks),
      rank: null,
    };
  });
}

/**
 * How a request is named beside its holder: "L7 ×2" for a gang's ranks, "" for a lease.
 * @param {LeaseRow|TimelineRow} row
 * @returns {string}
 */
function gangName(row) {
  return row.gang ? `${row.lease_id} ×${row.ranks}` : "";
}

/**
 * Who holds a request, as the view names them: "alice", or "alice L7 ×2" for a gang.
 * @param {LeaseRow|TimelineRow} row
 * @returns {string}
 */
function holderName(row) {
  return row.gang ? `${row.user} ${gangName(row)}` : row.user;
}

/**
 * Replace the view with one message (connecting, no broker reachable ...).
 * @param {HTMLElement} root
 * @param {string} text
 * @param {"info"|"error"} [kind]
 */
export function renderMessage(root, text, kind = "info") {
  root.classList.add("gpushare-view");
  root.replaceChildren(
    h("div", `gpushare-message gpushare-message-${kind}`, text),
  );
}

/**
 * Draw the whole view for one snapshot, replacing what `root` showed before.
 * @param {HTMLElement} root
 * @param {Snapshot} snapshot
 * @param {RenderOptions} [options]
 */
export function renderSnapshot(root, snapshot, options = {}) {
  const admin = snapshot.is_admin && typeof options.onAdmin === "function";
  root.classList.add("gpushare-view");
  // The queue comes before the devices: in a narrow side panel it is what people look
  // for, and a GPU's profiles would push it out of sight.
  const parts = [
    renderHeader(snapshot),
    renderOwnSessions(snapshot),
    renderQueue(snapshot, admin ? options : {}),
    ...snapshot.devices.map((d) =>
      renderDevice(d, snapshot, admin ? options : {}),
    ),
  ];
  if (snapshot.is_admin && !admin && options.adminHint) {
    parts.push(h("div", "gpushare-note", options.adminHint));
  }
  // The header names the inventory already: a note saying it again is left out.
  for (const note of snapshot.notes || [])
    if (note !== snapshot.inventory_description)
      parts.push(h("div", "gpushare-note", note));
  root.replaceChildren(...parts.filter((p) => p !== null));
}

/**
 * @param {Snapshot} s
 * @returns {HTMLElement}
 */
function renderHeader(s) {
  const who = s.is_admin ? `${s.you} (admin)` : s.you;
  return h("div", "gpushare-header", undefined, [
    h("span", "gpushare-node", `node ${s.node || s.host}`),
    h("span", "gpushare-you", `you: ${who}`),
    h(
      "span",
      "gpushare-broker",
      `broker: ${s.mode} mode, ${s.inventory_description}`,
    ),
  ]);
}

/**
 * The viewer's own sessions with their state, highlighted; null when there are none.
 * @param {Snapshot} s
 * @returns {HTMLElement|null}
 */
function renderOwnSessions(s) {
  const own = s.leases.filter((l) => l.own && l.state !== "released");
  if (!own.length) return null;
  const rows = groupLeases(own).map((l) => {
    const where = l.devices.length ? ` on GPU ${l.devices.join(", ")}` : "";
    const detail =
      l.state === "queued"
        ? `#${l.position ?? "?"} in queue, waiting ${formatDuration(l.since_s)}`
        : `${l.states}${where} for ${formatDuration(l.since_s)}`;
    const reason = l.reason ? ` (${l.reason})` : "";
    const name = l.gang
      ? [gangName(l), l.label].filter(Boolean).join(" · ")
      : l.label || l.lease_id;
    return h("li", `gpushare-own gpushare-state-${l.state}`, undefined, [
      h("span", `gpushare-badge gpushare-badge-${l.state}`, l.state),
      h("span", "gpushare-own-label", name),
      h(
        "span",
        "gpushare-own-detail",
        `${describePriority(l.priority)}, ${detail}${reason}`,
      ),
    ]);
  });
  return h("div", "gpushare-section gpushare-own-sessions", undefined, [
    h("div", "gpushare-section-title", "Your sessions"),
    h("ul", "gpushare-list", undefined, rows),
  ]);
}

/**
 * @param {DeviceView} d
 * @param {Snapshot} s
 * @param {RenderOptions} options
 * @returns {HTMLElement}
 */
function renderDevice(d, s, options) {
  const info = d.info;
  const leases = s.leases.filter(
    (l) => l.device_index === info.index && ACTIVE_STATES.has(l.state),
  );
  const title = h("div", "gpushare-device-title", undefined, [
    h("span", "gpushare-device-name", `GPU ${info.index} · ${info.name}`),
    h(
      "span",
      "gpushare-device-spec",
      `${formatMiB(info.memory_total_mib)} · ${info.multiprocessor_count} SMs`,
    ),
    info.simulated
      ? h("span", "gpushare-badge gpushare-badge-simulated", "simulated")
      : null,
    d.drained
      ? h("span", "gpushare-badge gpushare-badge-drained", "drained")
      : null,
    options.onAdmin ? adminButton(d, options.onAdmin) : null,
  ]);
  return h("div", "gpushare-device", undefined, [
    title,
    renderLayout(info, leases),
    renderMemory(d, leases),
    renderUtilization(d),
    renderHolders(d, s),
    renderTimeline(d, s),
  ]);
}

/** What each rung of the ladder is called, for the timeline's marks. */
const LEVEL_NAMES = ["gate", "yield", "abort", "lock", "evict"];

/**
 * The last minutes of the device: one row per lease (newest at the bottom), a bar from
 * its grant to its end coloured by priority, its pauses hatched and labelled with the
 * ladder level that held it. Answers "why was my cell slow?". A gang's ranks on the
 * device are one row (groupSpans), its bar labelled "L7 ×2".
 * @param {DeviceView} d
 * @param {Snapshot} s
 * @returns {HTMLElement|null}
 */
export function renderTimeline(d, s) {
  const spans = d.timeline || [];
  if (!spans.length) return null;
  const rows = groupSpans(spans).slice(-8);
  // Zoom to what there is (at least a minute, at most what the broker keeps), so that
  // a few seconds of contention are wide enough to read.
  const earliest = Math.min(...rows.map((r) => r.start));
  const windowS = Math.min(
    s.timeline_window_s || 600,
    Math.max(60, Math.ceil((s.time - earliest) / 60) * 60),
  );
  const width = 600;
  const row = 14;
  const height = rows.length * row + 2;
  const from = s.time - windowS;
  /** @param {number} t */
  const x = (t) => (Math.max(0, t - from) / windowS) * width;
  const drawing = svg("svg", {
    class: "gpushare-timeline-svg",
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: "none",
    height,
    role: "img",
  });
  /** @type {HTMLElement[]} */
  const labels = [];
  rows.forEach((span, i) => {
    const y = i * row + 1;
    const end = span.end ?? s.time;
    const band = describePriority(span.priority).split(" ")[0];
    const name = gangName(span) || span.lease_id;
    const bar = svg("rect", {
      class: `gpushare-timeline-bar gpushare-priority-${band}${span.own ? " gpushare-timeline-own" : ""}${span.gang ? " gpushare-timeline-gang" : ""}`,
      x: x(span.start).toFixed(1),
      y,
      width: Math.max(1.5, x(end) - x(span.start)).toFixed(1),
      height: row - 3,
    });
    const pauses = span.pauses || [];
    const paused = pauses
      .map(
        (p) =>
          `paused ${formatDuration((p.end ?? s.time) - p.start)} at level ${p.level} (${LEVEL_NAMES[p.level] || "?"})`,
      )
      .join("; ");
    const title = svg("title", {});
    title.textContent =
      `${span.user} · ${name} · ${describePriority(span.priority)} · ` +
      `${formatDuration(end - span.start)}${span.end == null ? " so far" : ""}` +
      (paused ? ` · ${paused}` : "");
    bar.appendChild(title);
    drawing.appendChild(bar);
    if (span.gang) labels.push(timelineLabel(name, x(span.start) / width, y));
    for (const p of pauses) {
      const mark = svg("rect", {
        class: `gpushare-timeline-pause gpushare-level-${p.level}`,
        x: x(p.start).toFixed(1),
        y,
        width: Math.max(1.5, x(p.end ?? s.time) - x(p.start)).toFixed(1),
        height: row - 3,
        "data-level": p.level,
      });
      const why = svg("title", {});
      why.textContent = `${span.user} ${name} paused at level ${p.level} (${LEVEL_NAMES[p.level] || "?"}) for ${formatDuration((p.end ?? s.time) - p.start)}`;
      mark.appendChild(why);
      drawing.appendChild(mark);
    }
  });
  const legend = rows.flatMap((span) =>
    (span.pauses || []).map(
      (p) =>
        `${span.user} ${gangName(span) || span.lease_id} paused ${formatDuration((p.end ?? s.time) - p.start)} at level ${p.level} (${LEVEL_NAMES[p.level] || "?"})`,
    ),
  );
  return h("div", "gpushare-timeline", undefined, [
    h(
      "span",
      "gpushare-caption",
      `last ${Math.round(windowS / 60)} min, now at the right: ${rows.length === 1 ? "1 lease" : `${rows.length} leases`}`,
    ),
    labels.length
      ? h("div", "gpushare-timeline-track", undefined, [drawing, ...labels])
      : drawing,
    legend.length ? h("div", "gpushare-timeline-pauses", pausesText(legend)) : null,
  ]);
}

/** Pauses listed under the panel's timeline: the last few, said to be a few of all. */
const PAUSES_LISTED = 3;

/**
 * The pauses' sentences as one line: all of them, or how many there are and the last
 * PAUSES_LISTED, so that the text never counts fewer pauses than the drawing shows.
 * @param {string[]} sentences
 * @returns {string}
 */
function pausesText(sentences) {
  const listed = sentences.slice(-PAUSES_LISTED);
  const text = listed.join("; ");
  return sentences.length > listed.length
    ? `${sentences.length} pauses, the last ${listed.length}: ${text}`
    : text;
}

/**
 * The name of a gang's bar, laid over the drawing in HTML: text inside the SVG would be
 * stretched with it (the drawing takes the panel's width whatever its height). It sits
 * on the bar's start, or, for a bar that starts in the right half (a recent one, too
 * short to carry it), just before it, so that it stays inside the drawing.
 * @param {string} text
 * @param {number} start where the bar starts, as a fraction of the drawing's width
 * @param {number} top the bar's top, in pixels
 * @returns {HTMLElement}
 */
function timelineLabel(text, start, top) {
  const label = h("span", "gpushare-timeline-label", text);
  if (start <= 0.5) {
    label.style.left = `${(100 * start).toFixed(1)}%`;
    label.style.maxWidth = `${(100 * (1 - start)).toFixed(1)}%`;
  } else {
    label.style.right = `${(100 * (1 - start)).toFixed(1)}%`;
    label.style.maxWidth = `${(100 * start).toFixed(1)}%`;
  }
  label.style.top = `${top + 1}px`; // below the drawing's 1 px border
  return label;
}

/**
 * @param {DeviceView} d
 * @param {(request: AdminRequest) => void} onAdmin
 * @returns {HTMLElement}
 */
function adminButton(d, onAdmin) {
  const action = d.drained ? "undrain" : "drain";
  const button = /** @type {HTMLButtonElement} */ (
    h("button", "gpushare-admin-button", d.drained ? "Undrain" : "Drain")
  );
  button.title = d.drained
    ? `Accept new sessions on GPU ${d.info.index} again`
    : `Stop granting new sessions on GPU ${d.info.index}; running ones finish`;
  button.addEventListener("click", () =>
    onAdmin({ action, device: d.info.index }),
  );
  return button;
}

/**
 * The MIG layout to scale on the 8 memory slices, or the whole GPU and what it could be cut into.
 * @param {DeviceInfo} info
 * @param {LeaseView[]} leases
 * @returns {HTMLElement}
 */
function renderLayout(info, leases) {
  if (!info.mig_enabled) {
    const profiles = [...info.profiles].sort(
      (a, b) =>
        a.memory_slices - b.memory_slices ||
        a.slice_count - b.slice_count ||
        a.id - b.id,
    );
    const whole = h("div", "gpushare-slices", undefined, [
      slot(
        0,
        MEMORY_SLICES,
        "gpushare-slot gpushare-slot-whole",
        "MIG off: whole GPU",
      ),
    ]);
    const list = profiles.map((p) => {
      const strip = h(
        "div",
        "gpushare-slices gpushare-slices-mini",
        undefined,
        [
          ...Array.from({ length: MEMORY_SLICES }, (_, i) =>
            slot(i, 1, "gpushare-slot-grid", ""),
          ),
          ...packedPlacements(p).map((start) =>
            slot(start, p.memory_slices, "gpushare-slot-possible", ""),
          ),
        ],
      );
      strip.title =
        `${p.name}: ${p.memory_slices} of ${MEMORY_SLICES} memory slices each; ` +
        `may start at slice ${p.placements.join(", ")}`;
      return h("li", "gpushare-profile", undefined, [
        h("span", "gpushare-profile-name", p.name),
        strip,
        h(
          "span",
          "gpushare-profile-spec",
          `${formatMiB(p.memory_mib)}, ${p.multiprocessor_count} SMs, up to ${p.instance_count}×`,
        ),
      ]);
    });
    // Folded: seven rows of what the GPU could become are reference, not state.
    const folded = h("details", "gpushare-profiles-fold", undefined, [
      h(
        "summary",
        "gpushare-section-title",
        `Could be cut into (${profiles.length} MIG profiles)`,
      ),
      h("ul", "gpushare-profiles", undefined, list),
    ]);
    return h("div", "gpushare-layout gpushare-mig-off", undefined, [
      whole,
      renderShares(info, leases),
      folded,
    ]);
  }
  const used = new Set();
  const cells = info.instances.map((inst) => {
    for (let i = inst.start; i < inst.start + inst.size; i++) used.add(i);
    const users = leases.filter((l) => l.mig_uuid === inst.uuid);
    const who = users.map((l) => l.user).join(", ");
    const cls = users.some((l) => l.own)
      ? "gpushare-slot gpushare-slot-instance gpushare-slot-own"
      : users.length
        ? "gpushare-slot gpushare-slot-instance gpushare-slot-busy"
        : "gpushare-slot gpushare-slot-instance";
    const cell = slot(
      inst.start,
      inst.size,
      cls,
      who ? `${inst.name} · ${who}` : inst.name,
    );
    cell.title = `${inst.name}: ${formatMiB(inst.memory_mib)}, ${inst.multiprocessor_count} SMs`;
    return cell;
  });
  for (let i = 0; i < MEMORY_SLICES; i++) {
    if (!used.has(i))
      cells.push(slot(i, 1, "gpushare-slot gpushare-slot-free", "free"));
  }
  const pending =
    info.mig_pending !== info.mig_enabled ? " (MIG mode change pending)" : "";
  return h("div", "gpushare-layout gpushare-mig-on", undefined, [
    h(
      "div",
      "gpushare-section-title",
      `MIG on: ${info.instances.length} instances${pending}`,
    ),
    h("div", "gpushare-slices", undefined, cells),
  ]);
}

/**
 * Where the instances go when the whole GPU is cut into `p` only: non-overlapping
 * placements, first fit, at most `instance_count` of them.
 * @param {MigProfile} p
 * @returns {number[]}
 */
export function packedPlacements(p) {
  const taken = new Set();
  const starts = [];
  for (const start of [...p.placements].sort((a, b) => a - b)) {
    if (starts.length >= p.instance_count) break;
    const span = Array.from({ length: p.memory_slices }, (_, i) => start + i);
    if (span.some((i) => taken.has(i) || i >= MEMORY_SLICES)) continue;
    span.forEach((i) => taken.add(i));
    starts.push(start);
  }
  return starts;
}

/**
 * Software slices of a GPU with MIG off: each lease with a share of the SMs below the
 * whole GPU, drawn to its share and named with its holder; nothing when none has one.
 * @param {DeviceInfo} info
 * @param {LeaseView[]} leases
 * @returns {HTMLElement|null}
 */
function renderShares(info, leases) {
  const shared = groupLeases(
    leases.filter(
      (l) => l.sm_share < 1 && (l.state === "running" || l.state === "paused"),
    ),
  );
  if (!shared.length) return null;
  const bar = h("div", "gpushare-shares");
  let used = 0;
  for (const l of shared) {
    const pct = Math.min(100 - used, Math.round(l.sm_share * 100));
    used += pct;
    const who = holderName(l);
    const cell = h(
      "div",
      `gpushare-share${l.own ? " gpushare-share-own" : ""} gpushare-state-${l.state}`,
      `${who} · ${pct} %`,
    );
    cell.style.width = `${pct}%`;
    cell.title = `${who}: ${pct} % of the ${info.multiprocessor_count} SMs (${Math.round(l.sm_share * info.multiprocessor_count)} SMs), ${l.states}`;
    bar.appendChild(cell);
  }
  if (used < 100) {
    const free = h(
      "div",
      "gpushare-share gpushare-share-free",
      `free ${100 - used} %`,
    );
    free.style.width = `${100 - used}%`;
    bar.appendChild(free);
  }
  return h("div", "gpushare-shares-block", undefined, [
    h("span", "gpushare-caption", "software slices (share of the SMs)"),
    bar,
  ]);
}

/**
 * A cell of the slice strip placed at `start`, `size` slices wide (CSS grid columns).
 * @param {number} start
 * @param {number} size
 * @param {string} cls
 * @param {string} text
 * @returns {HTMLElement}
 */
function slot(start, size, cls, text) {
  const cell = h("div", cls, text);
  cell.style.gridColumn = `${start + 1} / span ${Math.max(1, size)}`;
  cell.style.gridRow = "1";
  return cell;
}

/**
 * Memory of the device: one segment per lease holding memory there (own name, others as
 * the broker names them), then, hatched, what each user's processes hold outside any
 * lease (idle notebooks; "other processes" for programs the broker does not know).
 * Parked and evicted leases hold their memory on the host: they are named in the legend,
 * not drawn on the device.
 * @param {DeviceView} d
 * @param {LeaseView[]} leases
 * @returns {HTMLElement}
 */
function renderMemory(d, leases) {
  const total = Math.max(1, d.info.memory_total_mib);
  const bar = h("div", "gpushare-membar");
  const legend = h("ul", "gpushare-legend");
  /**
   * @param {string} cls
   * @param {number} mib
   * @param {string} title
   */
  const segment = (cls, mib, title) => {
    const seg = h("div", cls);
    seg.style.width = `${Math.min(100, (100 * mib) / total)}%`;
    seg.title = title;
    bar.appendChild(seg);
  };
  // A gang's ranks held on the device and on the host are grouped apart: each memory
  // is drawn (or not) where it is.
  const onDevice = leases.filter((l) => l.state !== "evicted");
  const onHost = leases.filter((l) => l.state === "evicted");
  for (const l of [...groupLeases(onDevice), ...groupLeases(onHost)]) {
    const mib = Math.round(l.memory_bytes / MIB);
    const parked = l.label === PARKED_LABEL;
    const where =
      l.state === "evicted"
        ? parked
          ? "parked on the host"
          : "evicted to the host"
        : l.states;
    const who = holderName(l);
    if (l.state !== "evicted") {
      const cls = `gpushare-memseg ${l.own ? "gpushare-memseg-own" : "gpushare-memseg-other"}`;
      segment(
        `${cls} gpushare-state-${l.state}`,
        mib,
        `${who}: ${formatMiB(mib)} (${where})`,
      );
    }
    legend.appendChild(
      h(
        "li",
        l.own ? "gpushare-legend-own" : "",
        `${who} ${formatMiB(mib)} ${where}`,
      ),
    );
  }
  const outside = Object.entries(d.memory_outside_leases_mib || {}).sort(
    (a, b) => b[1] - a[1] || a[0].localeCompare(b[0]),
  );
  let outsideMiB = 0;
  for (const [who, mib] of outside) {
    outsideMiB += mib;
    const text = `${who} ${formatMiB(mib)} idle, outside any lease`;
    segment("gpushare-memseg gpushare-memseg-idle", mib, text);
    legend.appendChild(h("li", "gpushare-legend-idle", text));
  }
  const held = outsideMiB ? `, ${formatMiB(outsideMiB)} outside leases` : "";
  const caption = `memory: ${formatMiB(d.memory_leased_mib)} leased${held}, ${formatMiB(
    d.memory_used_mib,
  )} in use of ${formatMiB(d.info.memory_total_mib)}`;
  return h("div", "gpushare-memory", undefined, [
    h("div", "gpushare-caption", caption),
    bar,
    legend.childElementCount ? legend : null,
  ]);
}

/**
 * Utilisation now and a sparkline of its recent history (0-100 %).
 * @param {DeviceView} d
 * @returns {HTMLElement}
 */
function renderUtilization(d) {
  const history = d.utilization_history.length
    ? d.utilization_history
    : [d.utilization_pct];
  const width = 120;
  const height = 24;
  const step = history.length > 1 ? width / (history.length - 1) : width;
  const points = history
    .map((v, i) => {
      const y =
        height - (Math.min(100, Math.max(0, v)) / 100) * (height - 2) - 1;
      return `${(i * step).toFixed(1)},${y.toFixed(1)}`;
    })
    .join(" ");
  const spark = svg("svg", {
    class: "gpushare-sparkline",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: "none",
  });
  spark.appendChild(
    svg("polyline", {
      points: history.length > 1 ? points : `0,${height - 1} ${points}`,
    }),
  );
  return h("div", "gpushare-utilization", undefined, [
    h("span", "gpushare-caption", `utilization ${d.utilization_pct} %`),
    spark,
  ]);
}

/**
 * Who holds the device now.
 * @param {DeviceView} d
 * @param {Snapshot} s
 * @returns {HTMLElement}
 */
function renderHolders(d, s) {
  const byId = new Map(s.leases.map((l) => [l.lease_id, l]));
  const holders = groupLeases(
    d.holders.flatMap((id) => {
      const lease = byId.get(id);
      return lease ? [lease] : [];
    }),
  );
  if (!holders.length)
    return h(
      "div",
      "gpushare-holder gpushare-holder-none",
      "free: nobody holds it",
    );
  const text = holders
    .map(
      (l) =>
        `${holderName(l)} (${describePriority(l.priority)}, ${l.states} ${formatDuration(l.since_s)})`,
    )
    .join("; ");
  return h("div", "gpushare-holder", `held by ${text}`);
}

/**
 * The queue in order, with priority, waiting time and what each waits for.
 * @param {Snapshot} s
 * @param {RenderOptions} options
 * @returns {HTMLElement}
 */
function renderQueue(s, options) {
  const queued = groupLeases(s.leases.filter((l) => l.state === "queued")).sort(
    (a, b) =>
      (a.position ?? 1e9) - (b.position ?? 1e9) || b.priority - a.priority,
  );
  const title = h(
    "div",
    "gpushare-section-title",
    `Queue: ${queued.length} waiting`,
  );
  if (!queued.length)
    return h("div", "gpushare-section gpushare-queue", undefined, [title]);
  const columns = ["#", "who", "priority", "waiting"];
  const head = h(
    "tr",
    undefined,
    undefined,
    columns.map((t) => h("th", undefined, t)),
  );
  const width = columns.length;
  // Each request is two rows: its facts, short enough for a narrow panel, then why it
  // waits across the whole width (a column that narrow wraps a sentence word by word),
  // with an admin's Cancel button at its end: a column of its own would push the table
  // past a narrow panel's edge as soon as a name is long.
  const rows = queued.flatMap((l) => {
    const own = l.own ? " gpushare-queue-own" : "";
    const row = h("tr", `gpushare-queue-row${own}`, undefined, [
      h("td", undefined, String(l.position ?? "")),
      h("td", undefined, holderName(l)),
      h("td", undefined, describePriority(l.priority)),
      h("td", undefined, formatDuration(l.since_s)),
    ]);
    let cancel = null;
    if (options.onAdmin) {
      const onAdmin = options.onAdmin;
      cancel = h("button", "gpushare-admin-button gpushare-queue-cancel", "Cancel");
      cancel.title = `Cancel ${l.user}'s queued request ${l.lease_id}`;
      cancel.addEventListener("click", () =>
        onAdmin({ action: "cancel", lease_id: l.lease_id }),
      );
    }
    const estimate =
      l.estimate_s == null
        ? null
        : h(
            "span",
            "gpushare-queue-estimate",
            // The holder's usual hold time, counted down: once it is used up, that is
            // what it says, never a promise ("any moment now") the holder may not keep.
            l.estimate_s < 1
              ? " — the holder's usual time is up"
              : ` — about ${formatDuration(l.estimate_s)} left`,
          );
    const why = /** @type {HTMLTableCellElement} */ (
      h("td", undefined, undefined, [
        document.createTextNode(l.reason || l.label || ""),
        estimate,
        cancel,
      ])
    );
    why.colSpan = width;
    return [row, h("tr", `gpushare-queue-reason${own}`, undefined, [why])];
  });
  return h("div", "gpushare-section gpushare-queue", undefined, [
    title,
    h("table", "gpushare-queue-table", undefined, [
      h("thead", undefined, undefined, [head]),
      h("tbody", undefined, undefined, rows),
    ]),
  ]);
}

/**
 * anywidget entry point: draw the model's `snapshot` (or its `error`) and redraw on change.
 * @param {{model: {get: (name: string) => any, on: (event: string, cb: () => void) => void,
 *   off: (event: string, cb: () => void) => void}, el: HTMLElement}} context
 * @returns {() => void} cleanup that stops listening
 */
function render({ model, el }) {
  const draw = () => {
    const error = model.get("error");
    const snapshot = model.get("snapshot");
    if (error) renderMessage(el, error, "error");
    else if (snapshot && Array.isArray(snapshot.devices)) {
      renderSnapshot(el, snapshot, {
        adminHint:
          "Admin controls (drain, cancel) are in the JupyterLab GPU panel.",
      });
    } else renderMessage(el, "Connecting to the GPU broker…");
  };
  draw();
  model.on("change:snapshot", draw);
  model.on("change:error", draw);
  return () => {
    model.off("change:snapshot", draw);
    model.off("change:error", draw);
  };
}

export default { render };
