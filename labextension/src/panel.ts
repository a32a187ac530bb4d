/**
 * The left-sidebar GPU panel and the status-bar item, both fed by one SnapshotStream.
 *
 * The panel draws with the notebook widget's own view (gpushare_ext/widgets/occupancy.js),
 * so both show the same picture; admin buttons appear only when the broker says the
 * viewer is an admin (the stream's snapshot, which the server extension renews often
 * enough that a new admin sees them without a reload), and their actions go to the
 * server extension, never to a kernel.
 */
import { Notification } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import {
  renderMessage,
  renderSnapshot,
  statusSummary
} from '../../gpushare_ext/widgets/occupancy.js';
import type { AdminRequest } from '../../gpushare_ext/widgets/occupancy.js';
import { GpushareError, postAdmin, SnapshotStream, StreamEvent } from './api';

/** Sentence shown when the server extension cannot reach a broker. */
export const NO_BROKER_PREFIX = 'No GPU broker reachable';

/** The sidebar panel: the node, every GPU, the queue and your sessions, live. */
export class GpuPanel extends Widget {
  constructor(
    private readonly stream: SnapshotStream,
    openDashboard?: () => void
  ) {
    super();
    this.id = 'gpushare-panel';
    this.addClass('gpushare-panel');
    this.title.caption = 'GPUs: layout, queue and occupancy (gpushare)';
    const heading = document.createElement('div');
    heading.className = 'gpushare-panel-title';
    heading.textContent = 'GPUs';
    if (openDashboard) {
      const button = document.createElement('button');
      button.className = 'jp-Button gpushare-dashboard-button';
      button.textContent = 'Dashboard';
      button.title = 'Open the GPU dashboard: the last hour of every GPU';
      button.addEventListener('click', openDashboard);
      heading.append(button);
    }
    this._view = document.createElement('div');
    this.node.append(heading, this._view);
    stream.changed.connect(this._onEvent, this);
    if (stream.last) {
      this._onEvent(stream, stream.last);
    } else {
      renderMessage(this._view, 'Connecting to the GPU broker…');
    }
  }

  dispose(): void {
    this.stream.changed.disconnect(this._onEvent, this);
    super.dispose();
  }

  private _onEvent(_: SnapshotStream, event: StreamEvent): void {
    if (event.kind === 'unavailable') {
      renderMessage(this._view, event.message, 'error');
      return;
    }
    renderSnapshot(this._view, event.snapshot, {
      onAdmin: request => void this._admin(request)
    });
    // A long label ends in an ellipsis at the panel's edge (occupancy.css): its tooltip
    // reads it whole (plain text, as an attribute).
    for (const label of this._view.querySelectorAll<HTMLElement>('.gpushare-own-label')) {
      label.title = label.textContent ?? '';
    }
  }

  private async _admin(request: AdminRequest): Promise<void> {
    const what =
      request.action === 'cancel'
        ? `cancel request ${request.lease_id}`
        : `${request.action} GPU ${request.device}`;
    try {
      const reply = await postAdmin(request);
      Notification.success(reply.detail || `Done: ${what}`, { autoClose: 3000 });
    } catch (error) {
      const message = error instanceof GpushareError ? error.message : String(error);
      Notification.error(`Could not ${what}: ${message}`, { autoClose: 6000 });
    }
  }

  private _view: HTMLElement;
}

/** The status-bar item: "GPU: running, 2 queued"; a click opens the panel. */
export class GpuStatusItem extends Widget {
  constructor(
    private readonly stream: SnapshotStream,
    onClick: () => void
  ) {
    super();
    this.addClass('gpushare-statusbar');
    this.node.title = 'gpushare: click to open the GPU panel';
    this.node.addEventListener('click', onClick);
    stream.changed.connect(this._onEvent, this);
    this.node.textContent = 'GPU: …';
    if (stream.last) {
      this._onEvent(stream, stream.last);
    }
  }

  dispose(): void {
    this.stream.changed.disconnect(this._onEvent, this);
    super.dispose();
  }

  private _onEvent(_: SnapshotStream, event: StreamEvent): void {
    const unavailable = event.kind === 'unavailable';
    this.node.classList.toggle('gpushare-statusbar-unavailable', unavailable);
    if (unavailable) {
      this.node.textContent = 'GPU: no broker';
      this.node.title = event.message;
    } else {
      this.node.textContent = statusSummary(event.snapshot);
      this.node.title = `gpushare on ${event.snapshot.node}: click to open the GPU panel`;
    }
  }
}
