/**
 * The dashboard's three charts of one GPU, drawn with uPlot on a shared time axis (the
 * last hour, now at the right): utilisation and the queue, memory by user (stacked:
 * leased, outside leases, parked), and the lease timeline (bars in lanes, pauses in the
 * colour of their ladder rung, hover details).
 *
 * Colours come from JupyterLab's theme variables, read when a chart is made, so the
 * dashboard rebuilds its charts when the theme changes. Every text drawn (names, labels)
 * goes onto the canvas or into `textContent`, never into markup. Each chart says what it
 * drew in `data-points` (samples or bars) and `data-pauses`, for the browser tests.
 */
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

import {
  describePriority,
  formatDuration,
  formatMiB
} from '../../gpushare_ext/widgets/occupancy.js';
import type { IDeviceHistory, ILaneBar } from './history';
import { packLanes, stackMemory } from './history';

/** What each rung of the ladder is called (as in the panel's timeline). */
export const LEVEL_NAMES = ['gate', 'yield', 'abort', 'lock', 'evict'];

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
  palette: string[]; // for other users
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

/** The colours of the theme in force where `node` is. */
export function readTheme(node: HTMLElement): ITheme {
  const color = (variable: string, fallback: string) => resolved(node, variable, fallback);
  const family = getComputedStyle(node).getPropertyValue('--jp-ui-font-family').trim();
  return {
    text: color('--jp-ui-font-color1', '#212121'),
    muted: color('--jp-ui-font-color2', '#616161'),
    grid: color('--jp-border-color2', '#e0e0e0'),
    background: color('--jp-layout-color1', '#ffffff'),
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
    palette: [
      '#8e24aa',
      '#00897b',
      '#f4511e',
      '#3949ab',
      '#c0ca33',
      '#6d4c41',
      '#d81b60',
      '#039be5'
    ].map(fallback => resolved(node, '--gpushare-unset', fallback)),
    font: `12px ${family || 'system-ui, sans-serif'}`
  };
}

/** `rgb(r, g, b)` with an alpha. */
export function alpha(color: string, value: number): string {
  const parts = color.match(/[\d.]+/g);
  if (!parts || parts.length < 3) return color;
  return `rgba(${parts[0]}, ${parts[1]}, ${parts[2]}, ${value})`;
}

function userColor(theme: ITheme, user: string, own: boolean): string {
  if (own) return theme.own;
  let hash = 0;
  for (const char of user) hash = (hash * 31 + char.charCodeAt(0)) >>> 0;
  return theme.palette[hash % theme.palette.length];
}

/** "14:05": short enough for a tick every 70 px on a laptop's screen. */
function clock(seconds: number): string {
  const at = new Date(seconds * 1000);
  return `${String(at.getHours()).padStart(2, '0')}:${String(at.getMinutes()).padStart(2, '0')}`;
}

/** The time axis all three charts share: the last window, now at the right. */
function timeAxis(theme: ITheme): uPlot.Axis {
  return {
    stroke: theme.muted,
    grid: { stroke: theme.grid, width: 1 },
    ticks: { stroke: theme.grid, width: 1 },
    font: theme.font,
    space: 70,
    values: (_u, splits) => splits.map(clock)
  };
}

/** Room beside each plot, the same in every chart, so that their time axes line up. */
const AXIS_PX = 64;

/** An empty axis that only takes the room of one, where a chart has nothing to scale. */
function spacer(side: 1 | 3): uPlot.Axis {
  return { side, size: AXIS_PX, values: () => [], grid: { show: false }, ticks: { show: false } };
}

function valueAxis(theme: ITheme, label: string, extra: Partial<uPlot.Axis> = {}): uPlot.Axis {
  return {
    stroke: theme.muted,
    grid: { stroke: theme.grid, width: 1 },
    ticks: { stroke: theme.grid, width: 1 },
    font: theme.font,
    labelFont: theme.font,
    label,
    size: AXIS_PX,
    ...extra
  };
}

/** What every chart of the dashboard has: its size and a cursor that does not zoom. */
function baseOptions(
  width: number,
  height: number
): Pick<uPlot.Options, 'width' | 'height' | 'cursor'> {
  return { width, height, cursor: { drag: { x: false, y: false }, points: { size: 6 } } };
}

/** One chart: where it sits, the uPlot, and how to give it new data. */
export interface IChart {
  plot: uPlot;
  update(history: IDeviceHistory, now: number, windowS: number): void;
}

function countDrawn(host: HTMLElement, points: number, pauses = 0): void {
  host.dataset.points = String(points);
  host.dataset.pauses = String(pauses);
}

/** Utilisation (%) and the queue's length (requests), over the hour. */
export function utilizationChart(
  host: HTMLElement,
  theme: ITheme,
  width: number,
  history: IDeviceHistory,
  now: number,
  windowS: number
): IChart {
  const data = (h: IDeviceHistory): uPlot.AlignedData => [h.times, h.utilization_pct, h.queued];
  const plot = new uPlot(
    {
      ...baseOptions(width, 200),
      scales: {
        x: { time: true, range: () => [now - windowS, now] },
        pct: { range: [0, 100] },
        queue: { range: (_u, _min, max) => [0, Math.max(4, Math.ceil(max))] }
      },
      series: [
        { label: 'time', value: (_u, v) => (v == null ? '--' : clock(v)) },
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
        timeAxis(theme),
        valueAxis(theme, 'utilization %', { scale: 'pct' }),
        valueAxis(theme, 'queued', { scale: 'queue', side: 1, grid: { show: false } })
      ]
    },
    data(history),
    host
  );
  countDrawn(host, history.times.length);
  return {
    plot,
    update(h, at, window) {
      now = at;
      windowS = window;
      plot.setData(data(h));
      countDrawn(host, h.times.length);
    }
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
  theme: ITheme,
  width: number,
  history: IDeviceHistory,
  now: number,
  windowS: number
): IChart {
  let current = history;
  const memory = history.memory;
  const series: uPlot.Series[] = [
    { label: 'time', value: (_u, v) => (v == null ? '--' : clock(v)) }
  ];
  const bands: uPlot.Band[] = [];
  memory.forEach((s, i) => {
    const color = userColor(theme, s.user, s.own);
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
  const plot = new uPlot(
    {
      ...baseOptions(width, 240),
      scales: {
        x: { time: true, range: () => [now - windowS, now] },
        y: { range: [0, Math.max(1, history.memory_total_mib)] }
      },
      series,
      bands,
      axes: [
        timeAxis(theme),
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
  const drawn = memory.length ? history.times.length * memory.length : 0;
  countDrawn(host, drawn);
  return {
    plot,
    update(h, at, window) {
      now = at;
      windowS = window;
      // A new user or kind changes the series: the caller rebuilds the chart instead.
      current = h;
      plot.setData([h.times, ...stackMemory(h.memory, h.times.length)]);
      countDrawn(host, h.memory.length ? h.times.length * h.memory.length : 0);
    }
  };
}

const LANE_PX = 24;
const BAR_PX = 16;

function barName(bar: ILaneBar): string {
  const row = bar.row;
  const name = row.gang ? `${row.lease_id} ×${row.ranks}` : row.lease_id;
  return row.label ? `${name} ${row.label}` : name;
}

function describeBar(bar: ILaneBar, now: number): string {
  const row = bar.row;
  const end = row.end ?? now;
  const lines = [
    `${barName(bar)} · ${row.user}${row.own ? ' (you)' : ''}`,
    `${describePriority(row.priority)} priority · held ${formatDuration(end - row.start)}` +
      (row.end == null ? ' so far' : '') +
      ` · from ${new Date(row.start * 1000).toLocaleTimeString()}`
  ];
  for (const p of row.pauses ?? []) {
    lines.push(
      `paused ${formatDuration((p.end ?? now) - p.start)} at level ${p.level} ` +
        `(${LEVEL_NAMES[p.level] ?? '?'}) from ${new Date(p.start * 1000).toLocaleTimeString()}`
    );
  }
  return lines.join('\n');
}

/** The lease timeline: a bar per request in lanes, its pauses over it by ladder rung. */
export function timelineChart(
  host: HTMLElement,
  theme: ITheme,
  width: number,
  history: IDeviceHistory,
  now: number,
  windowS: number
): IChart {
  let bars = packLanes(history.spans, now);
  const lanes = () => Math.max(2, ...bars.map(b => b.lane + 1));
  const tip = document.createElement('div');
  tip.className = 'gpushare-dashboard-tip';
  tip.hidden = true;

  const draw = (u: uPlot) => {
    const ctx = u.ctx;
    const { left, top, width: w, height: hgt } = u.bbox;
    const ratio = devicePixelRatio || 1;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, w, hgt);
    ctx.clip();
    ctx.font = theme.font.replace(/^(\d+)px/, (_m, px) => `${Number(px) * ratio}px`);
    ctx.textBaseline = 'middle';
    ctx.textAlign = 'left';
    let pauses = 0;
    for (const bar of bars) {
      const row = bar.row;
      const x0 = u.valToPos(row.start, 'x', true);
      const x1 = Math.max(x0 + 2 * ratio, u.valToPos(row.end ?? now, 'x', true));
      const y = u.valToPos(bar.lane + 0.5, 'y', true) - (BAR_PX * ratio) / 2;
      const band = describePriority(row.priority).split(' ')[0];
      ctx.fillStyle = theme.priorities[band] ?? theme.priorities.normal;
      ctx.fillRect(x0, y, x1 - x0, BAR_PX * ratio);
      if (row.own) {
        ctx.strokeStyle = theme.text;
        ctx.lineWidth = ratio;
        ctx.strokeRect(x0, y, x1 - x0, BAR_PX * ratio);
      }
      for (const p of row.pauses ?? []) {
        const p0 = u.valToPos(p.start, 'x', true);
        const p1 = Math.max(p0 + 2 * ratio, u.valToPos(p.end ?? now, 'x', true));
        ctx.fillStyle = theme.levels[p.level] ?? theme.levels[4];
        ctx.fillRect(p0, y + 2 * ratio, p1 - p0, (BAR_PX - 4) * ratio);
        pauses += 1;
      }
      const name = barName(bar);
      const room = x1 - x0 - 6 * ratio;
      if (room > ctx.measureText(name.slice(0, 4)).width) {
        ctx.fillStyle = band === 'high' ? '#ffffff' : '#000000';
        ctx.fillText(fitted(ctx, name, room), x0 + 3 * ratio, y + (BAR_PX * ratio) / 2);
      }
    }
    ctx.restore();
    countDrawn(host, bars.length, pauses);
  };

  const hover = (u: uPlot) => {
    const { left, top } = u.cursor;
    if (left == null || top == null || left < 0) {
      tip.hidden = true;
      return;
    }
    const at = u.posToVal(left, 'x');
    const lane = Math.floor(u.posToVal(top, 'y'));
    const bar = bars.find(b => b.lane === lane && b.row.start <= at && at <= (b.row.end ?? now));
    if (!bar) {
      tip.hidden = true;
      return;
    }
    tip.textContent = describeBar(bar, now);
    tip.hidden = false;
    const flip = left > u.over.clientWidth / 2;
    tip.style.left = flip ? '' : `${left + 12}px`;
    tip.style.right = flip ? `${u.over.clientWidth - left + 12}px` : '';
    tip.style.top = `${Math.max(0, top - 8)}px`;
  };

  const height = () => lanes() * LANE_PX + 48;
  const plot = new uPlot(
    {
      ...baseOptions(width, height()),
      scales: {
        x: { time: true, range: () => [now - windowS, now] },
        y: { range: () => [0, lanes()] }
      },
      legend: { show: false },
      cursor: { drag: { x: false, y: false }, points: { show: false }, y: false },
      series: [{}, { show: false }],
      axes: [timeAxis(theme), spacer(3), spacer(1)],
      hooks: { draw: [draw], setCursor: [hover] }
    },
    [
      [now - windowS, now],
      [null, null]
    ],
    host
  );
  plot.over.appendChild(tip);
  return {
    plot,
    update(h, at, window) {
      now = at;
      windowS = window;
      bars = packLanes(h.spans, now);
      plot.setSize({ width: plot.width, height: height() });
      plot.setData([
        [now - windowS, now],
        [null, null]
      ]);
    }
  };
}

/** `text` cut with an ellipsis to `room` canvas pixels. */
function fitted(ctx: CanvasRenderingContext2D, text: string, room: number): string {
  if (ctx.measureText(text).width <= room) return text;
  let cut = text.length;
  while (cut > 1 && ctx.measureText(`${text.slice(0, cut)}…`).width > room) cut -= 1;
  return `${text.slice(0, cut)}…`;
}
