/**
 * The dashboard's data: the last hour of each GPU as GET {base}/gpushare/history answers it
 * (gpushare_ext.protocol.GpuHistory), and the reading of it the charts need (the lease
 * spans packed into lanes, the memory columns stacked).
 *
 * It only fetches and reshapes: no drawing, no timers. Names and labels arrive anonymised
 * and as plain text from the broker; nothing here turns them into markup.
 */
import { ServerConnection } from '@jupyterlab/services';

import { groupSpans } from '../../gpushare_ext/widgets/occupancy.js';
import type { TimelineRow, TimelineSpan } from '../../gpushare_ext/widgets/occupancy.js';
import { requestAPI } from './api';

/** What one user held on a GPU over time, of one kind, in MiB (one value per sample). */
export interface IMemorySeries {
  user: string;
  own: boolean;
  kind: 'leased' | 'outside' | 'parked';
  mib: number[];
}

/** A lease on the dashboard's timeline: a timeline span with its label (yours only). */
export interface IHistorySpan extends TimelineSpan {
  label?: string;
}

export interface IDeviceHistory {
  index: number;
  name: string;
  memory_total_mib: number;
  times: number[];
  utilization_pct: number[];
  queued: number[];
  memory: IMemorySeries[];
  spans: IHistorySpan[];
}

export interface IGpuHistory {
  time: number;
  window_s: number;
  sample_every_s: number;
  you: string;
  is_admin: boolean;
  devices: IDeviceHistory[];
}

/** The last hour of every GPU, for this user. */
export function fetchHistory(settings?: ServerConnection.ISettings): Promise<IGpuHistory> {
  return requestAPI<IGpuHistory>('history', {}, settings);
}

/** A request's bar on the timeline: its row (a lane shared by requests that never overlap). */
export interface ILaneBar {
  row: TimelineRow & { label?: string };
  lane: number;
}

/**
 * The spans as requests (a gang's ranks are one bar), each in the first lane free at its
 * start, so that an hour of leases takes as many lanes as were ever held at once.
 */
export function packLanes(spans: IHistorySpan[], now: number): ILaneBar[] {
  const rows = groupSpans(spans).sort((a, b) => a.start - b.start);
  const laneEnds: number[] = [];
  return rows.map(row => {
    const end = row.end ?? now;
    let lane = laneEnds.findIndex(laneEnd => laneEnd <= row.start);
    if (lane < 0) {
      lane = laneEnds.length;
      laneEnds.push(end);
    } else {
      laneEnds[lane] = end;
    }
    return { row, lane };
  });
}

/** The memory columns stacked bottom up (leased, then outside, then parked). */
export function stackMemory(memory: IMemorySeries[], samples: number): number[][] {
  const stacked: number[][] = [];
  let below = new Array<number>(samples).fill(0);
  for (const series of memory) {
    const total = below.map((value, i) => value + (series.mib[i] ?? 0));
    stacked.push(total);
    below = total;
  }
  return stacked;
}
