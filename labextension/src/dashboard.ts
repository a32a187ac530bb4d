/**
 * The GPU dashboard: a main-area view of every GPU over the last hour, live. Per GPU,
 * utilisation with the queue, memory by user (leased, outside leases, parked) and the
 * leases by user (charts.ts), one above the other on one time axis, zoomed together by
 * a drag, from GET {base}/gpushare/history, asked again every POLL_MS while the view is
 * shown (the broker samples every 5 s); a tab in the background asks nothing.
 *
 * It only shows what the broker sends: other users arrive as "user-xxxx" and labels only
 * for your own leases, as plain text, and they are put into the page as text. It never
 * acts on the broker.
 */
import { ServerConnection } from '@jupyterlab/services';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { formatMiB, renderMessage } from '../../gpushare_ext/widgets/occupancy.js';
import { GpushareError } from './api';
import {
  clock,
  CONTROL_PICTURES_FONT,
  HoverTip,
  IChart,
  IChartContext,
  ITheme,
  LEVEL_NAMES,
  memoryChart,
  readTheme,
  TimeWindow,
  timelineChart,
  UserColors,
  utilizationChart
} from './charts';
import { fetchHistory, IDeviceHistory, IGpuHistory } from './history';

export const DASHBOARD_ID = 'gpushare-dashboard';
export const POLL_MS = 5000;

type ChartMaker = typeof utilizationChart;

/** The order of a GPU's charts, top to bottom, on one time axis. */
const CHART_NAMES = ['utilization', 'memory', 'timeline'] as const;
type ChartName = (typeof CHART_NAMES)[number];
const CHART_MAKERS: Record<ChartName, ChartMaker> = {
  utilization: utilizationChart,
  memory: memoryChart,
  timeline: timelineChart
};

let sectionsMade = 0; // each section's charts get a cursor-sync key of their own

/**
 * One GPU's section: its heading, its three charts on one TimeWindow, and what keeps
 * them the width of their cards whatever changes it (a theme's fonts, a side panel, the
 * window): a ResizeObserver on each chart's box.
 */
class DeviceSection {
  constructor(
    readonly node: HTMLElement,
    theme: ITheme,
    colors: UserColors,
    tip: HoverTip,
    now: number,
    windowS: number
  ) {
    this._window = new TimeWindow(now, windowS);
    this._context = {
      theme,
      window: this._window,
      colors,
      tip,
      syncKey: `gpushare-dashboard-${++sectionsMade}`,
      zoom: (from, to) => {
        if (this._window.zoomTo(from, to)) this._rescale();
      },
      reset: () => {
        this._window.reset();
        this._rescale();
      }
    };
    this._resetButton.addEventListener('click', () => this._context.reset());
    this._resizes = new ResizeObserver(entries => {
      for (const entry of entries) {
        const name = (entry.target as HTMLElement).dataset.plotOf as ChartName | undefined;
        const chart = name ? this._charts.get(name) : undefined;
        const width = Math.floor(entry.contentRect.width);
        if (chart && width > 0 && width !== chart.plot.width) {
          chart.plot.setSize({ width, height: chart.plot.height });
        }
      }
    });
    this._showWindow();
  }

  show(device: IDeviceHistory, now: number, windowS: number): void {
    this.node.dataset.device = String(device.index);
    this._heading.textContent = `GPU ${device.index} · ${device.name} · ${formatMiB(device.memory_total_mib)}`;
    this._window.follow(now, windowS);
    const memoryKey = device.memory.map(s => `${s.kind}\u0000${s.user}`).join('\u0001');
    for (const name of CHART_NAMES) this._chart(name, device, name === 'memory' ? memoryKey : '');
    this._showWindow();
  }

  /** Charts in `theme`'s colours at the next show(), on the same time window. */
  retheme(theme: ITheme): void {
    this._context.theme = theme;
    this._context.tip.hide();
    for (const chart of this._charts.values()) chart.plot.destroy();
    this._charts.clear();
    this._keys.clear();
    this.node.querySelector('.gpushare-dashboard-key')?.replaceWith(timelineKey(theme));
  }

  /** Draw again (a font the canvas uses has loaded). */
  redraw(): void {
    for (const chart of this._charts.values()) chart.plot.redraw(false, true);
  }

  dispose(): void {
    this._resizes.disconnect();
    for (const chart of this._charts.values()) chart.plot.destroy();
    this._charts.clear();
  }

  private _chart(name: ChartName, device: IDeviceHistory, key: string): void {
    const chart = this._charts.get(name);
    if (chart && this._keys.get(name) === key) {
      chart.update(device);
      if (!this._window.zoomed) chart.rescale(); // the last hour moved on
      return;
    }
    chart?.plot.destroy();
    const host = this._host(name);
    host.replaceChildren();
    const width = Math.floor(host.clientWidth) || 600; // the observer corrects a guess
    this._charts.set(name, CHART_MAKERS[name](host, this._context, width, device));
    this._keys.set(name, key);
    // Observed anew, the box is measured again once laid out, whether or not its width
    // changes later: a chart made while the page was between two layouts (a theme's
    // styles going in) gets its card's width then.
    this._resizes.unobserve(host);
    this._resizes.observe(host);
  }

  private _rescale(): void {
    this._context.tip.hide();
    for (const chart of this._charts.values()) chart.rescale();
    this._showWindow();
  }

  /** The time shown, and the way back when it is a zoom. */
  private _showWindow(): void {
    const [from, to] = this._window.range();
    const zoomed = this._window.zoomed;
    this.node.dataset.window = `${from.toFixed(0)}-${to.toFixed(0)}`;
    this._resetButton.hidden = !zoomed;
    this._windowText.textContent = zoomed
      ? `zoomed to ${clock(from, true)} – ${clock(to, true)}`
      : 'drag across a chart to zoom in';
  }

  private _host(name: ChartName): HTMLElement {
    return this.node.querySelector(`[data-chart="${name}"] .gpushare-dashboard-plot`)!;
  }

  private get _heading(): HTMLElement {
    return this.node.querySelector('.gpushare-dashboard-gpu-title')!;
  }

  private get _resetButton(): HTMLButtonElement {
    return this.node.querySelector('.gpushare-dashboard-reset')!;
  }

  private get _windowText(): HTMLElement {
    return this.node.querySelector('.gpushare-dashboard-window')!;
  }

  private _window: TimeWindow;
  private _context: IChartContext;
  private _resizes: ResizeObserver;
  private _charts = new Map<ChartName, IChart>();
  private _keys = new Map<ChartName, string>();
}

function element(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function figure(name: ChartName, caption: string): HTMLElement {
  const node = element('figure', 'gpushare-dashboard-chart');
  node.dataset.chart = name;
  node.append(element('figcaption', 'gpushare-dashboard-caption', caption));
  const plot = element('div', 'gpushare-dashboard-plot');
  plot.dataset.plotOf = name;
  node.append(plot);
  return node;
}

/** What the timeline's colours mean: the priorities of the bars, the rungs of the pauses. */
function timelineKey(theme: ITheme): HTMLElement {
  const key = element('div', 'gpushare-dashboard-key');
  const swatch = (color: string, text: string) => {
    const item = element('span', 'gpushare-dashboard-key-item', text);
    const mark = element('span', 'gpushare-dashboard-swatch');
    mark.style.background = color;
    item.prepend(mark);
    key.append(item);
  };
  for (const band of ['low', 'normal', 'high']) swatch(theme.priorities[band], `${band} priority`);
  LEVEL_NAMES.forEach((name, level) =>
    swatch(theme.levels[level], `paused at level ${level} (${name})`)
  );
  return key;
}

/** The dashboard's content: every GPU's hour, asked for again while it is shown. */
export class GpuDashboard extends Widget {
  constructor(
    private readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {
    super();
    this.id = DASHBOARD_ID;
    this.addClass('gpushare-dashboard');
    this.title.label = 'GPU dashboard';
    this.title.caption = 'The last hour of every GPU (gpushare)';
    this.title.closable = true;
    const header = element('div', 'gpushare-dashboard-header');
    header.append(element('h1', 'gpushare-dashboard-title', 'GPU dashboard'));
    this._status = element('span', 'gpushare-dashboard-status', 'Connecting to the GPU broker…');
    header.append(this._status);
    this._body = element('div', 'gpushare-dashboard-body');
    this.node.append(header, this._body);
    this._tip = new HoverTip(this.node);
    // The canvas draws with the control pictures' font only once it has loaded (a label
    // shown before would keep empty boxes): load it now, and draw again when it is in.
    void document.fonts
      ?.load(`12px ${CONTROL_PICTURES_FONT}`, '\u241b\u2407')
      .then(() => {
        for (const section of this._sections.values()) section.redraw();
      })
      .catch(() => undefined); // a browser that cannot load it draws what it has
  }

  /** The theme changed: the charts are drawn again in its colours, on the same time. */
  themeChanged(): void {
    this._themeCache = null;
    const theme = this._theme();
    for (const section of this._sections.values()) section.retheme(theme);
    if (this._last) this._render(this._last);
  }

  /** Ask for the hour now (also what the timer does). */
  async refresh(): Promise<void> {
    try {
      const history = await fetchHistory(this.settings);
      if (this.isDisposed) return;
      this._last = history;
      this._render(history);
    } catch (error) {
      if (this.isDisposed) return;
      const message = error instanceof GpushareError ? error.message : String(error);
      this._status.textContent = message;
      this._status.classList.add('gpushare-dashboard-error');
      if (!this._last) renderMessage(this._body, message, 'error');
    }
  }

  dispose(): void {
    this._stop();
    this._drop();
    this._tip.dispose();
    super.dispose();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) this._start();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._start();
  }

  protected onBeforeHide(msg: Message): void {
    this._stop();
    this._tip.hide();
    super.onBeforeHide(msg);
  }

  protected onBeforeDetach(msg: Message): void {
    this._stop();
    super.onBeforeDetach(msg);
  }

  /** Asked at once, then every POLL_MS, while the view is shown. */
  private _start(): void {
    if (this._timer !== undefined) return;
    void this.refresh();
    this._timer = window.setInterval(() => void this.refresh(), POLL_MS);
  }

  private _stop(): void {
    if (this._timer !== undefined) window.clearInterval(this._timer);
    this._timer = undefined;
  }

  private _drop(): void {
    for (const section of this._sections.values()) section.dispose();
    this._sections.clear();
    this._body.replaceChildren();
  }

  private _render(history: IGpuHistory): void {
    this._status.classList.remove('gpushare-dashboard-error');
    this._status.textContent =
      `last ${Math.round(history.window_s / 60)} min, now at the right · a sample every ` +
      `${history.sample_every_s} s · updated ${clock(history.time, true)}`;
    if (!history.devices.length) {
      this._drop();
      renderMessage(this._body, 'The broker manages no GPU.');
      return;
    }
    if (!this._sections.size) this._body.replaceChildren();
    const theme = this._theme();
    for (const device of history.devices) {
      let section = this._sections.get(device.index);
      if (!section) {
        section = new DeviceSection(
          this._sectionNode(theme),
          theme,
          this._colors,
          this._tip,
          history.time,
          history.window_s
        );
        this._body.append(section.node);
        this._sections.set(device.index, section);
      }
      section.show(device, history.time, history.window_s);
    }
  }

  private _sectionNode(theme: ITheme): HTMLElement {
    const node = element('section', 'gpushare-dashboard-gpu');
    const heading = element('div', 'gpushare-dashboard-gpu-heading');
    const reset = element('button', 'jp-Button gpushare-dashboard-button gpushare-dashboard-reset');
    reset.textContent = 'Reset zoom';
    reset.title = 'Show the whole hour again (or double-click a chart)';
    heading.append(
      element('h2', 'gpushare-dashboard-gpu-title'),
      element('span', 'gpushare-dashboard-window'),
      reset
    );
    // One column: the three charts share one time axis, a time at the same x in each.
    const charts = element('div', 'gpushare-dashboard-charts');
    const timeline = figure('timeline', 'Leases by user, with their pauses by ladder level');
    timeline.append(timelineKey(theme));
    charts.append(
      figure('utilization', 'Utilization and queued requests'),
      figure('memory', 'Memory by user: leased (solid), outside leases and parked (dashed)'),
      timeline
    );
    node.append(heading, charts);
    return node;
  }

  private _theme(): ITheme {
    this._themeCache ??= readTheme(this.node);
    return this._themeCache;
  }

  private _status: HTMLElement;
  private _body: HTMLElement;
  private _last: IGpuHistory | null = null;
  private _sections = new Map<number, DeviceSection>();
  private _timer: number | undefined;
  private _themeCache: ITheme | null = null;
  private _tip: HoverTip;
  /** One colour per user on every GPU, for as long as the dashboard is open. */
  private _colors = new UserColors();
}
