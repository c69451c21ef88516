// Leases (docs/protocol.md, "Sessions"): SessionTable.sweep on the class, with explicit clocks, so nothing is timed.
import { describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { SessionTable, type EndReason } from '../src/daemon/session.js';

function table(leaseMs: number): { sessions: SessionTable; ended: EndReason[] } {
  const ended: EndReason[] = [];
  const sessions = new SessionTable({ ...defaultLimits(), leaseMs }, (_s, reason) => ended.push(reason));
  return { sessions, ended };
}

describe('SessionTable.sweep', () => {
  it('ends a session whose lease lapsed, not one within it or one with a request in flight', () => {
    const { sessions, ended } = table(1000);
    const idle = sessions.open(101, 'tzip-101-a-', 'idle', 2, 'r1');
    const busy = sessions.open(102, 'tzip-102-b-', 'busy', 2, 'r2');
    // One clock for both (opened a few ms apart on a loaded machine, the idle one lapsed 1 ms early at t0 + 999).
    const t0 = Date.now();
    idle.lastSeen = t0;
    busy.lastSeen = t0;
    busy.inflight = 1;
    expect(sessions.sweep(t0 + 999)).toBe(0);
    expect(sessions.sweep(t0 + 1001)).toBe(1);
    expect(ended).toEqual(['lease']);
    expect(sessions.size).toBe(1);
  });

  it('extends every lease by how late the sweep ran (a daemon starved of CPU reads heartbeats late too)', () => {
    const { sessions, ended } = table(1000);
    const s = sessions.open(103, 'tzip-103-c-', 'late', 2, 'r3');
    const t0 = s.lastSeen;
    // The timer fired 5 s late: the lease counts from 5 s later, so the session lives on...
    expect(sessions.sweep(t0 + 5500, 5000)).toBe(0);
    expect(ended).toEqual([]);
    // ...and lapses once the daemon kept up for a whole lease without hearing from it.
    expect(sessions.sweep(t0 + 6001, 0)).toBe(1);
    expect(ended).toEqual(['lease']);
  });
});
