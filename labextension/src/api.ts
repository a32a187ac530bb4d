/**
 * Every call from the panel to the server extension (gpushare_ext/server_ext) goes through
 * here, built on ServerConnection so URLs carry the server's base URL (JupyterHub's
 * /user/<name>/ prefix) and requests carry its auth token and XSRF header.
 *
 * The live view reads GET {base}/gpushare/stream, a Server-Sent Events stream, through a
 * streaming fetch (not EventSource, which cannot send the Authorization header).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import type { AdminRequest, Snapshot } from '../../gpushare_ext/widgets/occupancy.js';

/** The server extension's error body: {"error": code, "message": sentence}. */
export interface IErrorBody {
  error: string;
  message: string;
}

/** An error answer of the server extension, with the sentence the user should read. */
export class GpushareError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

/**
 * Call the server extension's REST API at {base}/gpushare/{endPoint}.
 *
 * @returns the decoded JSON body
 * @throws GpushareError with the server's message when the answer is not 2xx
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, 'gpushare', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new GpushareError(0, `The Jupyter server did not answer: ${error}`);
  }
  const text = await response.text();
  let data: unknown = text;
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    // not JSON: keep the text for the message below
  }
  if (!response.ok) {
    const body = data as Partial<IErrorBody>;
    const message =
      typeof body === 'object' && body?.message
        ? body.message
        : `${response.status} ${response.statusText}`;
    throw new GpushareError(response.status, message);
  }
  return data as T;
}

/** Send an admin action (drain, undrain, cancel) through the server, never the kernel. */
export function postAdmin(
  request: AdminRequest,
  settings?: ServerConnection.ISettings
): Promise<{ ok: boolean; detail: string }> {
  return requestAPI('admin', { method: 'POST', body: JSON.stringify(request) }, settings);
}

/** What the stream says: a snapshot, or why none can be had right now. */
export type StreamEvent =
  { kind: 'snapshot'; snapshot: Snapshot } | { kind: 'unavailable'; message: string };

/**
 * The broker's snapshots, live, from {base}/gpushare/stream.
 *
 * Reconnects after a pause when the stream ends or fails; `dispose()` stops it.
 */
export class SnapshotStream {
  constructor(
    private readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings(),
    private readonly retryMs = 2000
  ) {}

  /** Emitted for every snapshot and every "unavailable" notice. */
  get changed(): ISignal<this, StreamEvent> {
    return this._changed;
  }

  /** The last event seen, for views created after the stream started. */
  get last(): StreamEvent | null {
    return this._last;
  }

  start(): void {
    if (this._running) {
      return;
    }
    this._running = true;
    void this._loop();
  }

  dispose(): void {
    this._running = false;
    this._abort?.abort();
    Signal.clearData(this);
  }

  private _emit(event: StreamEvent): void {
    this._last = event;
    this._changed.emit(event);
  }

  private async _loop(): Promise<void> {
    while (this._running) {
      try {
        await this._readOnce();
      } catch (error) {
        if (!this._running) {
          return;
        }
        const message =
          error instanceof GpushareError ? error.message : `Lost the GPU stream: ${error}`;
        this._emit({ kind: 'unavailable', message });
      }
      await new Promise(resolve => setTimeout(resolve, this.retryMs));
    }
  }

  private async _readOnce(): Promise<void> {
    const url = URLExt.join(this.settings.baseUrl, 'gpushare', 'stream');
    this._abort = new AbortController();
    const response = await ServerConnection.makeRequest(
      url,
      { headers: { Accept: 'text/event-stream' }, signal: this._abort.signal },
      this.settings
    );
    if (!response.ok || !response.body) {
      let message = `${response.status} ${response.statusText}`;
      try {
        message = ((await response.json()) as IErrorBody).message || message;
      } catch {
        // keep the status line
      }
      throw new GpushareError(response.status, message);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    while (this._running) {
      const { value, done } = await reader.read();
      if (done) {
        return;
      }
      buffer += decoder.decode(value, { stream: true });
      let end: number;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        this._dispatch(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
    await reader.cancel();
  }

  /** Parse one SSE event ("event: name" and "data: ..." lines). */
  private _dispatch(block: string): void {
    let name = 'message';
    const data: string[] = [];
    for (const line of block.split('\n')) {
      if (line.startsWith('event:')) {
        name = line.slice(6).trim();
      } else if (line.startsWith('data:')) {
        data.push(line.slice(5).trimStart());
      }
    }
    if (!data.length) {
      return; // a comment / keep-alive
    }
    const payload = JSON.parse(data.join('\n'));
    if (name === 'snapshot') {
      this._emit({ kind: 'snapshot', snapshot: payload as Snapshot });
    } else if (name === 'unavailable') {
      this._emit({ kind: 'unavailable', message: (payload as IErrorBody).message });
    }
  }

  private _running = false;
  private _abort: AbortController | null = null;
  private _last: StreamEvent | null = null;
  private _changed = new Signal<this, StreamEvent>(this);
}
