/**
 * The GPU dashboard: a main-area view of every GPU over the last hour, live. Per GPU,
 * utilisation with the queue, memory by user (leased, outside leases, parked) and the
 * lease timeline (charts.ts), from GET {base}/gpushare/history, asked again every
 * POLL_MS while the view is shown (the broker samples every 5 s); a tab in the
 * background asks nothing.
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
  IChart,
  ITheme,
  LEVEL_NAMES,
  memoryChart,
  readTheme,
  timelineChart,
  utilizationChart
} from './charts';
import { fetchHistory, IDeviceHistory, IGpuHistory } from './history';

export const DASHBOARD_ID = 'gpushare-dashboard';
export const POLL_MS = 5000;

type ChartMaker = typeof utilizationChart;

/** One GPU's section: its heading and its three charts. */
class DeviceSection {
  constructor(
    readonly node: HTMLElement,
    private readonly theme: ITheme
  ) {}

  show(device: IDeviceHistory, now: number, windowS: number): void {
    this.node.dataset.device = String(device.index);
    this._heading.textContent = `GPU ${device.index} · ${device.name} · ${formatMiB(device.memory_total_mib)}`;
    this._chart('utilization', utilizationChart, device, now, windowS, '');
    const memoryKey = device.memory.map(s => `${s.kind}\u0000${s.user}`).join('\u0001');
    this._chart('memory', memoryChart, device, now, windowS, memoryKey);
    this._chart('timeline', timelineChart, device, now, windowS, '');
  }

  resize(): void {
    for (const [name, chart] of this._charts) {
      const width = this._host(name).clientWidth;
      if (width > 0 && width !== chart.plot.width) {
        chart.plot.setSize({ width, height: chart.plot.height });
      }
    }
  }

  dispose(): void {
    for (const chart of this._charts.values()) chart.plot.destroy();
    this._charts.clear();
  }

  private _chart(
    name: string,
    make: ChartMaker,
    device: IDeviceHistory,
    now: number,
    windowS: number,
    key: string
  ): void {
    const chart = this._charts.get(name);
    if (chart && this._keys.get(name) === key) {
      chart.update(device, now, windowS);
      return;
    }
    chart?.plot.destroy();
    const host = this._host(name);
    host.replaceChildren();
    this._charts.set(name, make(host, this.theme, host.clientWidth || 600, device, now, windowS));
    this._keys.set(name, key);
  }

  private _host(name: string): HTMLElement {
    return this.node.querySelector(`[data-chart="${name}"] .gpushare-dashboard-plot`)!;
  }

  private get _heading(): HTMLElement {
    return this.node.querySelector('.gpushare-dashboard-gpu-title')!;
  }

  private _charts = new Map<string, IChart>();
  private _keys = new Map<string, string>();
}

function element(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function figure(name: string, caption: string, wide = false): HTMLElement {
  const node = element(
    'figure',
    `gpushare-dashboard-chart${wide ? ' gpushare-dashboard-wide' : ''}`
  );
  node.dataset.chart = name;
  node.append(element('figcaption', 'gpushare-dashboard-caption', caption));
  node.append(element('div', 'gpushare-dashboard-plot'));
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
  }

  /** The theme changed: the charts are drawn again in its colours. */
  themeChanged(): void {
    this._themeCache = null;
    this._drop();
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
    super.onBeforeHide(msg);
  }

  protected onBeforeDetach(msg: Message): void {
    this._stop();
    super.onBeforeDetach(msg);
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    super.onResize(msg);
    for (const section of this._sections.values()) section.resize();
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
      `${history.sample_every_s} s · updated ${new Date(history.time * 1000).toLocaleTimeString()}`;
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
        section = new DeviceSection(this._sectionNode(theme), theme);
        this._body.append(section.node);
        this._sections.set(device.index, section);
      }
      section.show(device, history.time, history.window_s);
    }
  }

  private _sectionNode(theme: ITheme): HTMLElement {
    const node = element('section', 'gpushare-dashboard-gpu');
    node.append(element('h2', 'gpushare-dashboard-gpu-title'));
    const grid = element('div', 'gpushare-dashboard-grid');
    grid.append(
      figure('utilization', 'Utilization and queued requests'),
      figure('memory', 'Memory by user: leased (solid), outside leases and parked (dashed)')
    );
    const timeline = figure('timeline', 'Leases, with their pauses by ladder level', true);
    timeline.append(timelineKey(theme));
    grid.append(timeline);
    node.append(grid);
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
}
