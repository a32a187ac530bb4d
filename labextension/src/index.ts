/**
 * gpushare's JupyterLab plugin: a left-sidebar GPU panel and a status-bar item, both live
 * from the server extension's snapshot stream ({base}/gpushare/stream).
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvg from '../style/gpu.svg';
import { SnapshotStream } from './api';
import { GpuPanel, GpuStatusItem } from './panel';

export const gpuIcon = new LabIcon({ name: 'gpushare:gpu', svgstr: gpuSvg });

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpushare-ext:plugin',
  description: 'GPU occupancy, MIG layout and queue of this host, from the gpushare broker.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    const stream = new SnapshotStream(ServerConnection.makeSettings());
    const panel = new GpuPanel(stream);
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
