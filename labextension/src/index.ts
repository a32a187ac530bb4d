/**
 * gpushare's JupyterLab plugin: a left-sidebar GPU panel and a status-bar item, both live
 * from the server extension's snapshot stream ({base}/gpushare/stream), and the GPU
 * dashboard in the main area (the command "GPU dashboard", also a button in the panel).
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, IThemeManager, MainAreaWidget } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvg from '../style/gpu.svg';
import { SnapshotStream } from './api';
import { GpuDashboard } from './dashboard';
import { GpuPanel, GpuStatusItem } from './panel';

export const gpuIcon = new LabIcon({ name: 'gpushare:gpu', svgstr: gpuSvg });

/** The command that opens the dashboard (or brings it forward). */
export const OPEN_DASHBOARD = 'gpushare:open-dashboard';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpushare-ext:plugin',
  description: 'GPU occupancy, MIG layout and queue of this host, from the gpushare broker.',
  autoStart: true,
  optional: [IStatusBar, ICommandPalette, IThemeManager],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    themes: IThemeManager | null
  ) => {
    const settings = ServerConnection.makeSettings();
    let dashboard: MainAreaWidget<GpuDashboard> | null = null;
    app.commands.addCommand(OPEN_DASHBOARD, {
      label: 'GPU dashboard',
      caption: 'The last hour of every GPU: utilization, memory by user, queue, leases',
      icon: gpuIcon,
      execute: () => {
        if (!dashboard || dashboard.isDisposed) {
          dashboard = new MainAreaWidget({ content: new GpuDashboard(settings) });
          dashboard.id = 'gpushare-dashboard-area';
          dashboard.title.icon = gpuIcon;
          app.shell.add(dashboard, 'main');
        }
        app.shell.activateById(dashboard.id);
      }
    });
    palette?.addItem({ command: OPEN_DASHBOARD, category: 'GPU' });
    // Once the new theme's styles are in: the charts read their colours from them.
    themes?.themeChanged.connect(() =>
      requestAnimationFrame(() => dashboard?.content.themeChanged())
    );

    const stream = new SnapshotStream(settings);
    const panel = new GpuPanel(stream, () => void app.commands.execute(OPEN_DASHBOARD));
    panel.title.icon = gpuIcon;
    app.shell.add(panel, 'left', { rank: 600 });

    if (statusBar) {
      const item = new GpuStatusItem(stream, () => app.shell.activateById(panel.id));
      statusBar.registerStatusItem('gpushare-ext:status', {
        item,
        align: 'left',
        rank: 5
      });
    }
    stream.start();
  }
};

export default plugin;
