/**
 * The dashboard's three charts of one GPU, drawn with uPlot on one time axis: utilisation
 * and the queue, memory by user (stacked: leased, outside leases, parked), and the leases
 * (a band per user, a bar per request, pauses in the colour of their ladder rung).
 *
 * One time axis: every chart of a GPU reads its time range from one TimeWindow (the last
 * hour, now at the right, or what a drag zoomed to), keeps the same room beside its plot
 * (GUTTER_PX, left and right) and places its ticks with one rule (timeTicks), so a time
 * is at the same x in all three. Their cursors move together.
 *
 * Colours come from JupyterLab's theme variables, read when a chart is made, so the
 * dashboard rebuilds its charts when the theme changes; users' colours come from a
 * palette made for that theme's background (UserColors). Every text drawn (names,
 * labels) goes onto the canvas or into `textContent`, never into markup. Each chart says
 * what it drew in `data-points` (samples or bars), `data-pauses` and `data-ticks` (each
 * time tick and its x on the page), the lease chart also `data-lanes`, `data-users` and
 * `data-labelled` (bars that carry their name), for the browser tests.
 */
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

import {
  describePriority,
  formatDuration,
  formatMiB
} from '../../gpushare_ext/widgets/occupancy.js';
import type { IDeviceHistory, ILaneBar, IUserBand } from './history';
import { stackMemory, userBands } from './history';

/** What each rung of the ladder is called (as in the panel's timeline). */
export const LEVEL_NAMES = ['gate', 'yield', 'abort', 'lock', 'evict'];

/**
 * The font of the control pictures (occupancy.css's @font-face, a subset of Noto Sans
 * Symbols 2 limited to U+2400-U+2426): first in every font list, so "␛" and "␇" in
 * someone's label are drawn whatever font the theme chose, none of which has them.
 */
export const CONTROL_PICTURES_FONT = '"gpushare control pictures"';

/**
 * Colours for other users, one list per kind of background. Picked so that any two of
 * them, and each against the viewer's own colour (the theme's brand blue), differ by a
 * CIEDE2000 distance of at least 16 on the charts' background (white, or the dark
 * theme's #111): nine users apart at a glance, in both themes. A tenth other user
 * shares the first's colour (the legend still names each).
 */
const PALETTE_ON_LIGHT = [
  '#d95f02',
  '#1b9e77',
  '#9c27b0',
  '#e7298a',
  '#66a61e',
  '#8c564b',
  '#c9a100',
  '#666666',
  '#00acc1'
];
const PALETTE_ON_DARK = [
  '#ff8a50',
  '#4db6ac',
  '#ce93d8',
  '#f06292',
  '#9ccc65',
  '#a1887f',
  '#fff176',
  '#e0e0e0',
  '#b2ebf2'
];

/** The theme's colours, resolved to rgb() so that alpha can be applied on a canvas. */
export interface ITheme {
  text: string;
  muted: string;
  grid: string;
  background: string;
  own: string;
  accent: string;
  levels: string[]; // one per ladder rung
  priorities: Record<string, string>; // low, normal, high
  palette: string[]; // for other users, made for this background
  font: string;
}

function resolved(node: HTMLElement, variable: string, fallback: string): string {
  const probe = document.createElement('span');
  probe.style.color = `var(${variable}, ${fallback})`;
  node.appendChild(probe);
  const color = getComputedStyle(probe).color;
  probe.remove();
  return color || fallback;
}

/** The red, green and blue of an `rgb()`/`rgba()` or `#rrggbb` colour, 0-255. */
function channels(color: string): number[] {
  if (color.startsWith('#') && color.length === 7) {
    return [1, 3, 5].map(i => parseInt(color.slice(i, i + 2), 16));
  }
  return (color.match(/[\d.]+/g) ?? ['0', '0', '0']).slice(0, 3).map(Number);
}

/** WCAG's relative luminance, 0 (black) to 1 (white). */
function luminance(color: string): number {
  const [r, g, b] = channels(color).map(c => {
    const v = c / 255;
    return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

/** The colours of the theme in force where `node` is. */
export function readTheme(node: HTMLElement): ITheme {
  const color = (variable: string, fallback: string) => resolved(node, variable, fallback);
  const family = getComputedStyle(node).getPropertyValue('--jp-ui-font-family').trim();
  // The charts' cards are drawn on layout-color0 (dashboard.css).
  const background = color('--jp-layout-color0', '#ffffff');
  const palette = luminance(background) > 0.4 ? PALETTE_ON_LIGHT : PALETTE_ON_DARK;
  return {
    text: color('--jp-ui-font-color1', '#212121'),
    muted: color('--jp-ui-font-color2', '#616161'),
    grid: color('--jp-border-color2', '#e0e0e0'),
    background,
    own: color('--jp-brand-color1', '#1976d2'),
    accent: color('--jp-accent-color1', '#388e3c'),
    levels: [
      color('--jp-warn-color2', '#ffb74d'),
      color('--jp-warn-color1', '#f57c00'),
      color('--jp-warn-color0', '#e65100'),
      color('--jp-error-color1', '#d32f2f'),
      color('--jp-error-color0', '#b71c1c')
    ],
    priorities: {
      low: color('--jp-layout-color4', '#757575'),
      normal: color('--jp-brand-color3', '#90caf9'),
      high: color('--jp-brand-color1', '#1976d2')
    },
    palette: palette.map(hex => resolved(node, '--gpushare-unset', hex)),
    font: `12px ${CONTROL_PICTURES_FONT}, ${family || 'system-ui, sans-serif'}`
  };
}

/** `rgb(r, g, b)` with an alpha. */
export function alpha(color: string, value: number): string {
  const [r, g, b] = channels(color);
  return `rgba(${r}, ${g}, ${b}, ${value})`;
}

/**
 * Which palette colour each other user has, for the dashboard's lifetime: given in the
 * order users are first seen (a first look at once sorted by name), so that no two users
 * share one before the palette runs out, and a user keeps theirs on every GPU, across
 * refreshes and theme changes (the index stays; the theme gives the colour).
 */
export class UserColors {
  /** Users seen together, first sight of each: given colours in the order of their names. */
  meet(users: string[]): void {
    for (const user of [...new Set(users)].sort()) {
      if (!this._order.has(user)) this._order.set(user, this._order.size);
    }
  }

  colorOf(theme: ITheme, user: string, own: boolean): string {
    if (own) return theme.own;
    this.meet([user]);
    return theme.palette[this._order.get(user)! % theme.palette.length];
  }

  private _order = new Map<string, number>();
}

/**
 * The time a GPU's charts show: the last window of the broker's history, now at the
 * right, following it as it moves, or, once someone dragged across a chart, the part
 * they picked, held still until they reset it.
 */
export class TimeWindow {
  constructor(
    public now: number,
    public windowS: number
  ) {}

  /** The shortest time a drag zooms to: below it a drag is taken for a click. */
  static readonly SHORTEST_S = 10;

  get zoomed(): boolean {
    return this._zoom !== null;
  }

  range(): [number, number] {
    return this._zoom ?? [this.now - this.windowS, this.now];
  }

  follow(now: number, windowS: number): void {
    this.now = now;
    this.windowS = windowS;
  }

  /** Show from `from` to `to` (kept inside the history); false if too short to zoom to. */
  zoomTo(from: number, to: number): boolean {
    const earliest = this.now - this.windowS;
    const start = Math.max(earliest, Math.min(from, to));
    const end = Math.min(this.now, Math.max(from, to));
    if (end - start < TimeWindow.SHORTEST_S) return false;
    this._zoom = [start, end];
    return true;
  }

  reset(): void {
    this._zoom = null;
  }

  private _zoom: [number, number] | null = null;
}

/**
 * Shows one hover tip at a time, beside the pointer and never past the visible edges of
 * `container` (the dashboard). It lives in the page's body, `position: fixed`: inside the
 * dashboard, a tip at its bottom would grow what it scrolls, and move the charts from
 * under the pointer.
 */
export class HoverTip {
  constructor(private readonly container: HTMLElement) {
    this.node = document.createElement('div');
    this.node.className = 'gpushare-dashboard-tip';
    this.node.hidden = true;
    document.body.append(this.node);
  }

  readonly node: HTMLElement;

  /** `lines` (the first one its title) beside the pointer at `clientX`, `clientY`. */
  show(lines: string[], clientX: number, clientY: number): void {
    const rows = lines.map((line, i) => {
      const row = document.createElement('div');
      row.className = i === 0 ? 'gpushare-dashboard-tip-title' : 'gpushare-dashboard-tip-line';
      row.textContent = line;
      return row;
    });
    const edge = this.container.getBoundingClientRect();
    const margin = 4;
    this.node.style.maxWidth = `${Math.max(0, Math.min(420, edge.width - 2 * margin))}px`;
    this.node.replaceChildren(...rows);
    this.node.hidden = false;
    // Below and right of the pointer, else above or left of it, and at worst pressed
    // against the edge it would cross.
    const width = this.node.offsetWidth;
    const height = this.node.offsetHeight;
    const gap = 14;
    let left = clientX + gap;
    if (left + width > edge.right - margin) left = clientX - gap - width;
    left = Math.max(edge.left + margin, Math.min(left, edge.right - margin - width));
    let top = clientY + gap;
    if (top + height > edge.bottom - margin) top = clientY - gap - height;
    top = Math.max(edge.top + margin, Math.min(top, edge.bottom - margin - height));
    this.node.style.left = `${left}px`;
    this.node.style.top = `${top}px`;
  }

  hide(): void {
    this.node.hidden = true;
  }

  dispose(): void {
    this.node.remove();
  }
}

/** What every chart of one GPU shares: theme, time, colours, the tip, their cursor. */
export interface IChartContext {
  theme: ITheme;
  window: TimeWindow;
  colors: UserColors;
  tip: HoverTip;
  /** The key that moves the cursors of one GPU's charts together. */
  syncKey: string;
  /** A drag across a chart picked the time from `from` to `to`. */
  zoom(from: number, to: number): void;
  /** Back to the whole history (a double-click on a chart). */
  reset(): void;
}

/**
 * Room beside each plot, the same in every chart, so that their times line up: on the
 * left for an axis and its name (or the lease chart's users), on the right for the
 * queue's few numbers, drawn in the queue's colour instead of a name beside them.
 */
export const GUTTER_PX = 96;
export const RIGHT_GUTTER_PX = 40;
/** Of a gutter, what an axis's rotated name takes; the rest is the axis's numbers. */
const AXIS_NAME_PX = 30;
const TIME_AXIS_PX = 36;
/** Above each plot: room for the top value of its axis. */
const PADDING_TOP_PX = 10;

/** Steps between time ticks, in seconds; the first that leaves TICK_SPACE_PX between. */
const TICK_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200];
const TICK_SPACE_PX = 80;

/**
 * The time ticks from `min` to `max` on a plot `widthPx` wide: every chart of a GPU asks
 * this with the same range and width, so they all tick at the same times, on whole
 * minutes (or seconds) of the local clock.
 */
export function timeTicks(min: number, max: number, widthPx: number): number[] {
  const span = Math.max(1e-6, max - min);
  const step =
    TICK_STEPS_S.find(s => (s / span) * widthPx >= TICK_SPACE_PX) ??
    TICK_STEPS_S[TICK_STEPS_S.length - 1];
  const shift = -new Date(min * 1000).getTimezoneOffset() * 60; // local clock's offset
  const ticks: number[] = [];
  for (let t = Math.ceil((min + shift) / step) * step - shift; t <= max; t += step) {
    ticks.push(t);
  }
  return ticks;
}

function pad2(value: number): string {
  return String(value).padStart(2, '0');
}

/** "14:05", or "14:05:30" where the ticks are less than a minute apart. */
export function clock(seconds: number, withSeconds = false): string {
  const at = new Date(seconds * 1000);
  const hm = `${pad2(at.getHours())}:${pad2(at.getMinutes())}`;
  return withSeconds ? `${hm}:${pad2(at.getSeconds())}` : hm;
}

function plotWidthPx(u: uPlot): number {
  return u.bbox.width / (devicePixelRatio || 1);
}

function timeAxis(theme: ITheme): uPlot.Axis {
  return {
    stroke: theme.muted,
    grid: { stroke: theme.grid, width: 1 },
    ticks: { stroke: theme.grid, width: 1 },
    font: theme.font,
    size: TIME_AXIS_PX,
    splits: (u, _axis, min, max) => timeTicks(min, max, plotWidthPx(u)),
    values: (_u, splits) => {
      const withSeconds = splits.length > 1 && splits[1] - splits[0] < 60;
      return splits.map(t => clock(t, withSeconds));
    }
  };
}

/** The x on the page of every time tick, as `data-ticks` ("14:05@512.0 14:10@601.3"). */
function recordTicks(u: uPlot, host: HTMLElement): void {
  const [min, max] = [u.scales.x.min, u.scales.x.max];
  if (min == null || max == null) return;
  const left = u.over.getBoundingClientRect().left;
  const ticks = timeTicks(min, max, plotWidthPx(u));
  const withSeconds = ticks.length > 1 && ticks[1] - ticks[0] < 60;
  host.dataset.ticks = ticks
    .map(t => `${clock(t, withSeconds)}@${(left + u.valToPos(t, 'x')).toFixed(1)}`)
    .join(' ');
}

/** An empty axis that only takes a gutter's room, where a chart has nothing to scale. */
function spacer(side: 1 | 3): uPlot.Axis {
  return {
    side,
    size: side === 1 ? RIGHT_GUTTER_PX : GUTTER_PX,
    values: () => [],
    grid: { show: false },
    ticks: { show: false }
  };
}

/** A left axis with its name beside it, or a right one (`side: 1`) without: a gutter each. */
function valueAxis(theme: ITheme, label: string, extra: Partial<uPlot.Axis> = {}): uPlot.Axis {
  const named = extra.side !== 1;
  return {
    stroke: theme.muted,
    grid: { stroke: theme.grid, width: 1 },
    ticks: { stroke: theme.grid, width: 1 },
    font: theme.font,
    labelFont: theme.font,
    ...(named ? { label, labelSize: AXIS_NAME_PX } : {}),
    size: named ? GUTTER_PX - AXIS_NAME_PX : RIGHT_GUTTER_PX,
    ...extra
  };
}

/**
 * What every chart of the dashboard has: its size, the shared time scale and axis, and
 * a cursor that moves with the others of its GPU and zooms all of them by a drag.
 */
function timeChartOptions(
  context: IChartContext,
  host: HTMLElement,
  width: number,
  height: number
): Pick<uPlot.Options, 'width' | 'height' | 'padding' | 'cursor' | 'hooks'> & {
  timeScale: uPlot.Scale;
  timeAxis: uPlot.Axis;
} {
  return {
    width,
    height,
    padding: [PADDING_TOP_PX, 0, 0, 0],
    cursor: {
      drag: { x: true, y: false, setScale: false },
      points: { size: 6 },
      // No horizontal line: moved with another chart's pointer, it would mark no value.
      y: false,
      // Only the pointer's moves are shared: a drag zooms through the TimeWindow, once.
      sync: {
        key: context.syncKey,
        scales: ['x', null],
        setSeries: false,
        filters: { pub: type => type !== 'mousedown' && type !== 'mouseup' }
      }
    },
    timeScale: { time: true, range: () => context.window.range() },
    timeAxis: timeAxis(context.theme),
    hooks: {
      setSelect: [
        u => {
          const { left, width: dragged } = u.select;
          if (dragged > 0) {
            context.zoom(u.posToVal(left, 'x'), u.posToVal(left + dragged, 'x'));
          }
          u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
        }
      ],
      draw: [u => recordTicks(u, host)],
      ready: [u => u.over.addEventListener('dblclick', () => context.reset())]
    }
  };
}

/** One chart: its uPlot, how to give it new data, and how to follow the time window. */
export interface IChart {
  plot: uPlot;
  update(history: IDeviceHistory): void;
  /** The window moved (time went on, a zoom, a reset): draw that time. */
  rescale(): void;
}

function countDrawn(host: HTMLElement, points: number, pauses = 0): void {
  host.dataset.points = String(points);
  host.dataset.pauses = String(pauses);
}

function rescaleTime(plot: uPlot, window: TimeWindow): void {
  const [min, max] = window.range();
  plot.setScale('x', { min, max });
}

/** Utilisation (%) and the queue's length (requests), over the hour. */
export function utilizationChart(
  host: HTMLElement,
  context: IChartContext,
  width: number,
  history: IDeviceHistory
): IChart {
  const theme = context.theme;
  const data = (h: IDeviceHistory): uPlot.AlignedData => [h.times, h.utilization_pct, h.queued];
  const { timeScale, timeAxis: xAxis, ...common } = timeChartOptions(context, host, width, 200);
  const plot = new uPlot(
    {
      ...common,
      scales: {
        x: timeScale,
        pct: { range: [0, 100] },
        queue: { range: (_u, _min, max) => [0, Math.max(4, Math.ceil(max))] }
      },
      series: [
        { label: 'time', value: (_u, v) => (v == null ? '--' : clock(v, true)) },
        {
          label: 'utilization',
          scale: 'pct',
          stroke: theme.accent,
          fill: alpha(theme.accent, 0.15),
          width: 1.5,
          value: (_u, v) => (v == null ? '--' : `${v} %`)
        },
        {
          label: 'queued requests',
          scale: 'queue',
          stroke: theme.levels[1],
          width: 2,
          paths: uPlot.paths.stepped!({ align: 1 }),
          value: (_u, v) => (v == null ? '--' : String(v))
        }
      ],
      axes: [
        xAxis,
        valueAxis(theme, 'utilization %', { scale: 'pct' }),
        valueAxis(theme, 'queued', {
          scale: 'queue',
          side: 1,
          grid: { show: false },
          stroke: theme.levels[1]
        })
      ]
    },
    data(history),
    host
  );
  countDrawn(host, history.times.length);
  return {
    plot,
    update(h) {
      plot.setData(data(h));
      countDrawn(host, h.times.length);
    },
    rescale: () => rescaleTime(plot, context.window)
  };
}

const GIB = 1024; // MiB
const GIB_STEPS = [1, 2, 4, 8, 16, 32, 64, 128, 256].map(gib => gib * GIB);

const KIND_ALPHA: Record<string, number> = { leased: 0.75, outside: 0.4, parked: 0.15 };
const KIND_NAMES: Record<string, string> = {
  leased: 'leased',
  outside: 'outside leases',
  parked: 'parked'
};

/** Memory by user and kind, stacked, in GiB, up to the GPU's memory. */
export function memoryChart(
  host: HTMLElement,
  context: IChartContext,
  width: number,
  history: IDeviceHistory
): IChart {
  const theme = context.theme;
  let current = history;
  const memory = history.memory;
  context.colors.meet(memory.filter(s => !s.own).map(s => s.user));
  const series: uPlot.Series[] = [
    { label: 'time', value: (_u, v) => (v == null ? '--' : clock(v, true)) }
  ];
  const bands: uPlot.Band[] = [];
  memory.forEach((s, i) => {
    const color = context.colors.colorOf(theme, s.user, s.own);
    series.push({
      label: `${s.user} · ${KIND_NAMES[s.kind]}`,
      stroke: color,
      width: s.kind === 'parked' ? 1 : 1.5,
      dash: s.kind === 'leased' ? undefined : [4, 3],
      fill: alpha(color, KIND_ALPHA[s.kind]),
      // The legend says what this user held, not the stack's height.
      value: (_u, _v, _series, index) => {
        const held = index == null ? undefined : current.memory[i]?.mib[index];
        return held == null ? '--' : formatMiB(held);
      }
    });
    if (i > 0) bands.push({ series: [i + 1, i] });
  });
  const stacked = stackMemory(memory, history.times.length);
  const { timeScale, timeAxis: xAxis, ...common } = timeChartOptions(context, host, width, 240);
  const plot = new uPlot(
    {
      ...common,
      scales: {
        x: timeScale,
        y: { range: [0, Math.max(1, history.memory_total_mib)] }
      },
      series,
      bands,
      axes: [
        xAxis,
        valueAxis(theme, 'memory GiB', {
          incrs: GIB_STEPS,
          values: (_u, splits) => splits.map(mib => String(Math.round(mib / GIB)))
        }),
        spacer(1)
      ]
    },
    [history.times, ...stacked],
    host
  );
  const drawn = (h: IDeviceHistory) => (h.memory.length ? h.times.length * h.memory.length : 0);
  countDrawn(host, drawn(history));
  return {
    plot,
    update(h) {
      // A new user or kind changes the series: the caller rebuilds the chart instead.
      current = h;
      plot.setData([h.times, ...stackMemory(h.memory, h.times.length)]);
      countDrawn(host, drawn(h));
    },
    rescale: () => rescaleTime(plot, context.window)
  };
}

/** A lane of the lease chart: its height, and the bar's within it. */
const LANE_PX = 22;
const BAR_PX = 16;
/** The most pauses one tip lists (the latest); it counts the others. */
const TIP_PAUSES = 6;

function barName(row: ILaneBar['row']): string {
  const name = row.gang ? `${row.lease_id} ×${row.ranks}` : row.lease_id;
  return row.label ? `${name} ${row.label}` : name;
}

/** What a hover over a bar says, each fact named, the request's name first. */
function describeBar(bar: ILaneBar, now: number): string[] {
  const row = bar.row;
  const end = row.end ?? now;
  const lines = [barName(row)];
  lines.push(
    row.gang ? `request: ${row.lease_id}, ${row.ranks} ranks on this GPU` : `lease: ${row.lease_id}`
  );
  if (row.label) lines.push(`label: ${row.label}`);
  lines.push(`user: ${row.user}${row.own ? ' (you)' : ''}`);
  lines.push(`priority: ${describePriority(row.priority)}`);
  lines.push(
    row.end == null
      ? `held: ${formatDuration(end - row.start)} so far, since ${clock(row.start, true)}`
      : `held: ${formatDuration(end - row.start)}, ${clock(row.start, true)} to ${clock(end, true)}`
  );
  const pauses = row.pauses ?? [];
  if (pauses.length > TIP_PAUSES) {
    lines.push(`paused ${pauses.length} times; the last ${TIP_PAUSES}:`);
  }
  for (const p of pauses.slice(-TIP_PAUSES)) {
    const until = p.end == null ? 'still paused' : `to ${clock(p.end, true)}`;
    lines.push(
      `paused ${formatDuration((p.end ?? now) - p.start)} at level ${p.level} ` +
        `(${LEVEL_NAMES[p.level] ?? '?'}), ${clock(p.start, true)} ${until}`
    );
  }
  return lines;
}

/** `text` cut with an ellipsis to `room` canvas pixels ("" if not even one letter fits). */
function fitted(ctx: CanvasRenderingContext2D, text: string, room: number): string {
  if (ctx.measureText(text).width <= room) return text;
  let cut = text.length;
  while (cut > 0 && ctx.measureText(`${text.slice(0, cut)}…`).width > room) cut -= 1;
  return cut > 0 ? `${text.slice(0, cut)}…` : '';
}

/**
 * The leases: a band per user (yours first), named in the left gutter with their colour
 * in the memory chart, and in it a bar per request from its grant to its end, coloured by
 * priority (yours outlined), with its pauses over it in the colour of their rung. A bar
 * carries its name and label where they fit, inside it or just after it. The chart is as
 * tall as the lanes of the requests in view: a drag that zooms in leaves out the others.
 */
export function timelineChart(
  host: HTMLElement,
  context: IChartContext,
  width: number,
  history: IDeviceHistory
): IChart {
  const theme = context.theme;
  let spans = history.spans;
  let bands: IUserBand[] = [];
  const bandsInView = () => {
    const [from, to] = context.window.range();
    bands = userBands(spans, context.window.now, from, to);
    context.colors.meet(bands.filter(b => !b.own).map(b => b.user));
    host.dataset.lanes = String(lanes());
    host.dataset.users = String(bands.length);
  };
  const lanes = () =>
    Math.max(
      1,
      bands.reduce((sum, band) => sum + band.lanes, 0)
    );
  const height = () => PADDING_TOP_PX + lanes() * LANE_PX + TIME_AXIS_PX;
  bandsInView();

  const draw = (u: uPlot) => {
    const ctx = u.ctx;
    const ratio = devicePixelRatio || 1;
    const { left, top, width: plotWidth, height: plotHeight } = u.bbox;
    const lane = plotHeight / lanes();
    const now = context.window.now;
    ctx.save();
    ctx.font = theme.font.replace(/^(\d+)px/, (_m, px) => `${Number(px) * ratio}px`);
    ctx.textBaseline = 'middle';
    // The gutter: each band's user, with the colour the memory chart gives them.
    ctx.textAlign = 'left';
    for (const band of bands) {
      const middle = top + (band.firstLane + band.lanes / 2) * lane;
      const swatch = 8 * ratio;
      ctx.fillStyle = context.colors.colorOf(theme, band.user, band.own);
      ctx.fillRect(6 * ratio, middle - swatch / 2, swatch, swatch);
      ctx.fillStyle = theme.text;
      const room = left - 6 * ratio - swatch - 10 * ratio;
      ctx.fillText(fitted(ctx, band.user, room), 6 * ratio + swatch + 4 * ratio, middle);
      if (band.firstLane > 0) {
        ctx.fillStyle = theme.grid;
        ctx.fillRect(0, top + band.firstLane * lane, left + plotWidth, ratio);
      }
    }
    ctx.beginPath();
    ctx.rect(left, top, plotWidth, plotHeight);
    ctx.clip();
    if (!bands.length) {
      ctx.textAlign = 'center';
      ctx.fillStyle = theme.muted;
      ctx.fillText('no leases in this time', left + plotWidth / 2, top + plotHeight / 2);
    }
    ctx.textAlign = 'left';
    const bars = bands.flatMap(band => band.bars);
    // Where the next bar of the same lane starts: a label after a bar stops before it.
    const nextStart = new Map<ILaneBar, number>();
    const byLane = new Map<number, ILaneBar[]>();
    for (const bar of bars) byLane.set(bar.lane, [...(byLane.get(bar.lane) ?? []), bar]);
    for (const laneBars of byLane.values()) {
      laneBars.forEach((bar, i) => {
        const next = laneBars[i + 1];
        nextStart.set(bar, next ? u.valToPos(next.row.start, 'x', true) : left + plotWidth);
      });
    }
    let pauses = 0;
    let labelled = 0;
    const barHeight = Math.min(BAR_PX * ratio, lane - 2 * ratio);
    for (const bar of bars) {
      const row = bar.row;
      const x0 = u.valToPos(row.start, 'x', true);
      const x1 = Math.max(x0 + 2 * ratio, u.valToPos(row.end ?? now, 'x', true));
      const y = top + bar.lane * lane + (lane - barHeight) / 2;
      const band = describePriority(row.priority).split(' ')[0];
      const fill = theme.priorities[band] ?? theme.priorities.normal;
      ctx.fillStyle = fill;
      ctx.fillRect(x0, y, x1 - x0, barHeight);
      if (row.own) {
        ctx.strokeStyle = theme.text;
        ctx.lineWidth = ratio;
        ctx.strokeRect(x0, y, x1 - x0, barHeight);
      }
      for (const p of row.pauses ?? []) {
        const p0 = u.valToPos(p.start, 'x', true);
        const p1 = Math.max(p0 + 2 * ratio, u.valToPos(p.end ?? now, 'x', true));
        ctx.fillStyle = theme.levels[p.level] ?? theme.levels[4];
        ctx.fillRect(p0, y + 2 * ratio, p1 - p0, barHeight - 4 * ratio);
        pauses += 1;
      }
      // The name inside the bar where its id fits, else after it, up to the next bar.
      const name = barName(row);
      const idWidth = ctx.measureText(row.lease_id).width;
      const visible0 = Math.max(x0, left);
      const inside = Math.min(x1, left + plotWidth) - visible0 - 6 * ratio;
      const after = (nextStart.get(bar) ?? left + plotWidth) - x1 - 8 * ratio;
      if (inside >= idWidth) {
        const text = fitted(ctx, name, inside);
        // Over the pause marks too: a rim of the bar's colour keeps each letter readable.
        ctx.strokeStyle = fill;
        ctx.lineWidth = 3 * ratio;
        ctx.lineJoin = 'round';
        ctx.strokeText(text, visible0 + 3 * ratio, y + barHeight / 2);
        ctx.fillStyle = luminance(fill) > 0.45 ? '#000000' : '#ffffff';
        ctx.fillText(text, visible0 + 3 * ratio, y + barHeight / 2);
        labelled += 1;
      } else if (after >= idWidth && x1 < left + plotWidth) {
        ctx.fillStyle = theme.text;
        ctx.fillText(fitted(ctx, name, after), x1 + 4 * ratio, y + barHeight / 2);
        labelled += 1;
      }
    }
    ctx.restore();
    countDrawn(host, bars.length, pauses);
    host.dataset.labelled = String(labelled);
  };

  const hover = (u: uPlot) => {
    const { left, top, event } = u.cursor;
    // The tip follows this chart's pointer only, not the cursor moved by another chart.
    if (!event || left == null || top == null || left < 0 || top < 0) {
      context.tip.hide();
      return;
    }
    const at = u.posToVal(left, 'x');
    const laneCss = u.bbox.height / (devicePixelRatio || 1) / lanes();
    const lane = Math.floor(top / laneCss);
    const now = context.window.now;
    // A bar of a few seconds is a pixel or two wide: a few pixels either side find it.
    const slack = Math.abs(u.posToVal(left + 3, 'x') - at);
    const bar = bands
      .flatMap(band => band.bars)
      .find(b => b.lane === lane && b.row.start - slack <= at && at <= (b.row.end ?? now) + slack);
    if (!bar) {
      context.tip.hide();
      return;
    }
    context.tip.show(describeBar(bar, now), event.clientX, event.clientY);
  };

  const {
    timeScale,
    timeAxis: xAxis,
    ...common
  } = timeChartOptions(context, host, width, height());
  const placeholder = (): uPlot.AlignedData => [context.window.range(), [null, null]];
  const plot = new uPlot(
    {
      ...common,
      cursor: { ...common.cursor, points: { show: false } },
      scales: { x: timeScale, y: { range: [0, 1] } },
      legend: { show: false },
      series: [{}, { show: false }],
      axes: [xAxis, spacer(3), spacer(1)],
      hooks: {
        ...common.hooks,
        draw: [...(common.hooks?.draw ?? []), draw],
        setCursor: [hover]
      }
    },
    placeholder(),
    host
  );
  plot.over.addEventListener('mouseleave', () => context.tip.hide());
  const fit = () => {
    if (plot.height !== height()) plot.setSize({ width: plot.width, height: height() });
  };
  return {
    plot,
    update(h) {
      spans = h.spans;
      bandsInView();
      fit();
      plot.setData(placeholder());
    },
    rescale() {
      bandsInView();
      fit();
      rescaleTime(plot, context.window);
    }
  };
}
